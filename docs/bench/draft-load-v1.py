"""What holding the draft as `--draft-quantization auto` picks costs at load: `load_model` of the real draft in bf16
with each setting, alternated in one process (the first of each pair after the page cache is warm), seconds per load.

    PYTHONPATH=services python docs/bench/draft-load-v1.py ROUNDS OUT.json [MODEL]   # 1 min for 4 rounds
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
import time

import torch

from tandem.models.loader import load_model

SETTINGS = ("none", "auto")


def main() -> None:
    rounds, out = int(sys.argv[1]), sys.argv[2]
    model = sys.argv[3] if len(sys.argv) > 3 else "qwen2.5-coder-0.5b-instruct"
    cpu = torch.device("cpu")
    load_model(model, device=cpu, dtype=torch.bfloat16, progress=False, quantization="none")  # page cache, imports
    seconds: dict[str, list[float]] = {setting: [] for setting in SETTINGS}
    weights: dict[str, str] = {}
    for index in range(rounds):
        for setting in SETTINGS if index % 2 == 0 else SETTINGS[::-1]:
            started = time.perf_counter()
            loaded = load_model(model, device=cpu, dtype=torch.bfloat16, progress=False, quantization=setting)
            seconds[setting].append(round(time.perf_counter() - started, 3))
            weights[setting] = loaded.weights
            del loaded
    medians = {setting: statistics.median(values) for setting, values in seconds.items()}
    report = {"model": model, "rounds": rounds, "seconds": seconds, "weights": weights, "median_s": medians,
              "auto_minus_none_s": round(medians["auto"] - medians["none"], 3),
              "code": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True).stdout.strip(),
              "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
              "threads": torch.get_num_threads()}
    with open(out, "w") as handle:
        json.dump(report, handle, indent=2)
    print(json.dumps({key: report[key] for key in ("weights", "median_s", "auto_minus_none_s")}))


if __name__ == "__main__":
    main()
