"""What a `tandem generate` start imports before it loads a model, timed in fresh processes: another checkout's
services/ (--old) against this one's, alternated (the old side first in odd rounds), and whether each loaded
inductor's compiler (torch._inductor.compile_fx, about 1 s of imports an eager start does not use).

    git worktree add /tmp/old HEAD~1
    PYTHONPATH=services python docs/bench/start-imports-v1.py --old /tmp/old/services --rounds 8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

PROBE = """
import sys, time
started = time.perf_counter()
import torch, transformers
import tandem.cli.main, tandem.engines.local, tandem.models.loader
from transformers import AutoModelForCausalLM, PreTrainedModel
print(time.perf_counter() - started, "torch._inductor.compile_fx" in sys.modules)
"""


def once(services: str) -> tuple[float, bool]:
    done = subprocess.run([sys.executable, "-c", PROBE], env={"PYTHONPATH": services, "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, check=True)
    seconds, inductor = done.stdout.split()
    return float(seconds), inductor == "True"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="the other checkout's services/ directory")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    sides = {"old": args.old, "new": str(Path(__file__).resolve().parents[2] / "services")}
    times: dict[str, list[float]] = {"old": [], "new": []}
    inductor: dict[str, bool] = {}
    for round_ in range(args.rounds):
        for side in ("old", "new") if round_ % 2 == 0 else ("new", "old"):
            seconds, inductor[side] = once(sides[side])
            times[side].append(round(seconds, 3))
            print(round_, side, times[side][-1], file=sys.stderr, flush=True)
    medians = {side: round(statistics.median(values), 3) for side, values in times.items()}
    report = {"seconds": times, "median_s": medians, "saved_s": round(medians["old"] - medians["new"], 3),
              "new_over_old": round(medians["new"] / medians["old"], 3), "loads_compile_fx": inductor}
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(json.dumps(report["median_s"] | {"saved_s": report["saved_s"]}))


if __name__ == "__main__":
    main()
