"""Loading the real pair as `tandem generate` does (models.loader.load_pair: files checked, weights read, draft
quantized, layers packed), timed in a fresh process for each checkout (`--old`: another checkout's services/,
against this one's), alternated round by round (the old side first in even rounds). Imports are not timed; the
process's peak resident memory is reported beside, and its resident memory once loaded (the pair held), anonymous
and file-backed (/proc/self/status: RssAnon, RssFile; since 0b49f60, the peak alone before).

    git worktree add /tmp/old HEAD~1
    PYTHONPATH=services python docs/bench/load-pair-v1.py --old /tmp/old/services --rounds 4 --json out.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

from checkout_ab import alternate, write_report

PROBE = """
import json, resource, sys, time
import torch
from tandem.core.device import select_dtype
from tandem.models.loader import load_pair
torch.set_num_threads(2)
device = torch.device("cpu")
started = time.perf_counter()
pair = load_pair(sys.argv[1], sys.argv[2], device=device, dtype=select_dtype(sys.argv[3], device), progress=False)
seconds = round(time.perf_counter() - started, 2)
status = {line.split(":")[0]: int(line.split()[1]) for line in open("/proc/self/status") if ":" in line
          and line.split(":")[0] in ("VmRSS", "RssAnon", "RssFile")}
print(json.dumps({"seconds": seconds,
                  "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
                  **{f"{key.lower()}_gb": round(kib / 2**20, 2) for key, kib in status.items()}}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="the other checkout's services/ directory")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    sides = {"old": args.old, "new": str(Path(__file__).resolve().parents[2] / "services")}
    runs = alternate(sides, PROBE, args.draft, args.target, args.dtype, rounds=args.rounds)
    write_report(args.json, {"draft": args.draft, "target": args.target, "dtype": args.dtype, "rounds": args.rounds},
                 runs, ("seconds", "peak_rss_gb", "vmrss_gb", "rssanon_gb", "rssfile_gb"), "seconds", "seconds")


if __name__ == "__main__":
    main()
