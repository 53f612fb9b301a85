"""How long a full garbage collection holds a serving process before and after its loaded heap is frozen
(core.gc_pause.freeze_loaded_heap, which `tandem serve` runs once serving, and each Ray worker once its model is
loaded). A full collection holds the GIL: in a gateway it stalls the event loop (every client's stream) and the
engine thread; in a worker, its forwards. Each arm loads in a fresh process:

- `in-process`: the engines `tandem serve --in-process` builds (the real pair, the CLI's own build options);
- `target-worker`: what a Ray target worker loads (workers.worker_base.load_runner on the target).

Each process times `--collections` full collections (gc.collect()), freezes, and times as many again.

    PYTHONPATH=services python docs/bench/heap-freeze-v1.py OUT.json [--collections 5]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ARMS = ("in-process", "target-worker")
TARGET = "qwen2.5-coder-1.5b-instruct"


def load(arm: str):
    if arm == "in-process":
        from tandem import engines
        from tandem.cli.common import engine_config
        from tandem.cli.main import build_parser
        from tandem.cli.serve import build_options

        args = build_parser().parse_args(["serve", "--in-process"])
        return engines.build(build_options(args, engine_config(args, True), None))
    from tandem.workers.worker_base import WorkerConfig, load_runner

    return load_runner(WorkerConfig(model=TARGET))


def timed_collections(count: int) -> list[float]:
    times = []
    for _ in range(count):
        started = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - started)
    return times


def measure(arm: str, count: int) -> dict:
    started = time.perf_counter()
    loaded = load(arm)
    load_s = time.perf_counter() - started
    tracked = len(gc.get_objects())
    before = timed_collections(count)
    started = time.perf_counter()
    gc.freeze()
    freeze_s = time.perf_counter() - started
    after = timed_collections(count)
    del loaded
    return {"arm": arm, "load_s": round(load_s, 1), "tracked_objects": tracked, "frozen": gc.get_freeze_count(),
            "full_collection_s": [round(t, 6) for t in before], "freeze_s": round(freeze_s, 6),
            "full_collection_after_freeze_s": [round(t, 6) for t in after],
            "median_before_s": statistics.median(before), "median_after_s": statistics.median(after)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--collections", type=int, default=5)
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # a child's one arm
    args = parser.parse_args()
    if args.arm:
        args.out.write_text(json.dumps(measure(args.arm, args.collections)))
        return
    runs = []
    for arm in ARMS:
        part = args.out.with_suffix(f".{arm}.json")
        print(f"{arm}: loading in a fresh process", flush=True)
        subprocess.run([sys.executable, __file__, str(part), "--collections", str(args.collections), "--arm", arm],
                       check=True, env=os.environ)
        runs.append(json.loads(part.read_text()))
        part.unlink()
        print(f"{arm}: a full collection {runs[-1]['median_before_s'] * 1e3:.1f} ms -> "
              f"{runs[-1]['median_after_s'] * 1e3:.3f} ms frozen ({runs[-1]['tracked_objects']} objects)", flush=True)
    args.out.write_text(json.dumps({"bench": "heap-freeze-v1", "python": sys.version.split()[0],
                                    "cpu": _cpu_name(), "runs": runs}, indent=1) + "\n")


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return ""


if __name__ == "__main__":
    main()
