"""served-threads-v1.py's per-thread counts for the sitting's engines in this process (plain and AUTO, the 8 prompts
at once, 2 repeats), to compare with the server's. Run it with the preload, as the server runs:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:.venv/lib/libiomp5.so PYTHONPATH=services \
        .venv/bin/python docs/bench/engine-threads-v1.py > engine-threads.out                         # 10 min
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

from tandem.bench.prompts import load_prompts
from tandem.bench.vllm_compare_tandem import batched, build_engines, sitting_job
from tandem.core.cpu_runtime import loaded


def main() -> None:
    spec = importlib.util.spec_from_file_location("st", Path(__file__).with_name("served-threads-v1.py"))
    counts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(counts)
    print(loaded(), flush=True)
    _, engines, ids = build_engines(sitting_job(load_prompts(None)[:8]))
    for _ in range(2):
        for mode in ("plain", "auto"):
            time.sleep(1.5)
            before = counts.thread_counts(os.getpid())
            result = batched(engines[mode], ids, 128)
            delta = counts.changed(before, counts.thread_counts(os.getpid()))
            print(mode, result["tokens"], result["seconds"], result["tok_s"], result["rounds"], json.dumps(delta),
                  flush=True)


if __name__ == "__main__":
    main()
