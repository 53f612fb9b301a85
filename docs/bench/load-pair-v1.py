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
import json
import statistics
import subprocess
import sys
from pathlib import Path

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


def once(services: str, draft: str, target: str, dtype: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, draft, target, dtype],
                          env={"PYTHONPATH": services, "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
                          capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"load_pair ({services}): {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


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
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for round_ in range(args.rounds):
        for side in ("old", "new") if round_ % 2 == 0 else ("new", "old"):
            runs[side].append(once(sides[side], args.draft, args.target, args.dtype))
            print(round_, side, runs[side][-1], file=sys.stderr, flush=True)
    keys = ("seconds", "peak_rss_gb", "vmrss_gb", "rssanon_gb", "rssfile_gb")
    median = {side: {key: round(statistics.median(run[key] for run in values), 3) for key in keys}
              for side, values in runs.items()}
    report = {"config": {"draft": args.draft, "target": args.target, "dtype": args.dtype, "rounds": args.rounds},
              "runs": runs, "median": median,
              "new_over_old_seconds": round(median["new"]["seconds"] / median["old"]["seconds"], 3)}
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(json.dumps({"median": median, "new_over_old_seconds": report["new_over_old_seconds"]}))


if __name__ == "__main__":
    main()
