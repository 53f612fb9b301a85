"""`tandem generate` end to end, for each checkout (`--services`: this one and a worktree of an older commit): wall
seconds from the command's start until it exits, the calibration's own seconds and calls (from its log line), and
the tokens, which must be the same on every side (greedy). The checkouts take turns, their order alternating round
by round (A B B A ...).

    git worktree add /tmp/old c99c97e
    PYTHONPATH=services python docs/bench/generate-start-v1.py --services /tmp/old/services services --json gen.json
    PYTHONPATH=services python docs/bench/generate-start-v1.py --services /tmp/old/services services \
        --dtype bfloat16 --rounds 1 --json gen-bf16.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "Write a Python function that checks whether a number is prime."
CALIBRATED = re.compile(r"calibrated in ([\d.]+) s \((\d+) target and draft calls")


def generate(services: str, flags: list[str]) -> dict:
    """One `tandem -v generate FLAGS` in a fresh interpreter on `services`."""
    out = Path(tempfile.mkdtemp(prefix="gen-start-")) / "out.json"
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "tandem", "-v", "generate", *flags, "--json", str(out), PROMPT],
                          env=os.environ | {"PYTHONPATH": services, "HF_HUB_OFFLINE": "1"}, capture_output=True,
                          text=True, timeout=3600)
    wall = round(time.monotonic() - began, 2)
    if done.returncode:
        raise SystemExit(f"tandem generate ({services}): {done.stderr[-3000:]}")
    calibrated = CALIBRATED.search(done.stderr)
    result = json.loads(out.read_text())
    return {"wall_s": wall, "calibration_s": float(calibrated[1]) if calibrated else None,
            "calibration_calls": int(calibrated[2]) if calibrated else None, "token_ids": result["token_ids"],
            "stats": result["stats"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", nargs="+", default=["services"], help="tandem checkouts' services/ directories")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="runs per checkout")
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    flags = ["--target", args.target, "--draft", args.draft, "--dtype", args.dtype, "--chat", "--temperature", "0",
             "--max-tokens", str(args.max_tokens)]
    runs: dict[str, list[dict]] = {services: [] for services in args.services}
    for round_ in range(args.rounds):
        order = args.services if round_ % 2 == 0 else args.services[::-1]
        for services in order:
            runs[services].append(generate(services, flags))
            run = runs[services][-1]
            print(f"{services}: {run['wall_s']} s, calibration {run['calibration_s']} s "
                  f"({run['calibration_calls']} calls)", file=sys.stderr, flush=True)
    outputs = {json.dumps(run["token_ids"]) for side in runs.values() for run in side}
    report = {"flags": flags, "rounds": args.rounds, "same_tokens_everywhere": len(outputs) == 1,
              "sides": {services: {"median_wall_s": statistics.median(r["wall_s"] for r in side),
                                   "median_calibration_s": statistics.median(r["calibration_s"] for r in side),
                                   "runs": side} for services, side in runs.items()}}
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(json.dumps({s: {k: v for k, v in side.items() if k != "runs"} for s, side in report["sides"].items()}))


if __name__ == "__main__":
    main()
