"""Loading the real draft as a w4 draft (models.loader.load_model, quantization "w4": int8 levels, oneDNN's int8
packing, the int4 copy), timed in a fresh process for each of two checkouts' services/ (`--old`, `--new`),
alternated round by round (the old side first in even rounds): the whole load and core.w4_linear.quantize_w4 within
it, and the process's peak resident memory.

    git worktree add /tmp/old HEAD~1
    PYTHONPATH=services python docs/bench/w4-load-v1.py --old /tmp/old/services --new services --json out.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

from checkout_ab import alternate, write_report

PROBE = """
import json, resource, sys, time
import torch
import tandem.models.loader as loader
torch.set_num_threads(2)
timed, quantize = {}, loader.quantize_w4
def quantize_timed(*args, **kwargs):
    started = time.perf_counter()
    try:
        return quantize(*args, **kwargs)
    finally:
        timed["quantize_s"] = round(time.perf_counter() - started, 2)
loader.quantize_w4 = quantize_timed
started = time.perf_counter()
draft = loader.load_model(sys.argv[1], device=torch.device("cpu"), dtype=torch.bfloat16, progress=False,
                          quantization="w4")
print(json.dumps({"load_s": round(time.perf_counter() - started, 2), **timed,
                  "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="one checkout's services/ directory")
    parser.add_argument("--new", required=True, help="the other's")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    sides = {"old": str(Path(args.old).resolve()), "new": str(Path(args.new).resolve())}
    runs = alternate(sides, PROBE, args.draft, rounds=args.rounds)
    write_report(args.json, {"draft": args.draft, "rounds": args.rounds, "old": args.old, "new": args.new}, runs,
                 ("load_s", "quantize_s", "peak_rss_gb"), "quantize", "quantize_s")


if __name__ == "__main__":
    main()
