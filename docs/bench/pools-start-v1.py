"""How long `tandem pools start` takes, from the command's start until it returns with every worker ready, for each
checkout (`--services`: this one and a worktree of an older commit) on a Ray head of its own whose workers import
that checkout; the checkouts take turns, their order alternating round by round, and each round's pools are stopped
before the next starts. `--serve`: `tandem serve` instead (Ray, its pools and a gateway in one command, no head of
ours), from its start until its readiness says SERVING.

    git worktree add /tmp/old e3291a9
    PYTHONPATH=services python docs/bench/pools-start-v1.py --services /tmp/old/services services --json start.json
    PYTHONPATH=services python docs/bench/pools-start-v1.py --services /tmp/old/services services \\
        --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --json start-real.json
    PYTHONPATH=services python docs/bench/pools-start-v1.py --services /tmp/old/services services --serve \\
        --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --json serve-real.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tandem.bench.local_cluster import checkout_heads, ray_env, serve_process


def tandem(services: str, address: str, *args: str) -> float:
    """`tandem ARGS` in a fresh interpreter on `services` against the head at `address`: its wall seconds."""
    env = ray_env(address) | {"PYTHONPATH": services, "HF_HUB_OFFLINE": "1"}
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "tandem", *args], env=env, capture_output=True, text=True,
                          timeout=3600)
    if done.returncode:
        raise SystemExit(f"tandem {' '.join(args)} ({services}): {done.stderr[-3000:]}")
    return round(time.monotonic() - began, 2)


def serve(services: str, flags: list[str]) -> float:
    """`tandem serve FLAGS` in a fresh interpreter on `services`: wall seconds until it is ready, then SIGTERM."""
    with serve_process(flags, Path(tempfile.mkdtemp(prefix="pst-serve-")) / "serve.err", services) as (_, start_s):
        return start_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", nargs="+", default=["services"], help="tandem checkouts' services/ directories")
    parser.add_argument("--target", default="", help="the pools' target (default: a tiny random model)")
    parser.add_argument("--draft", default="", help="their draft (default: the tiny draft)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=3, help="pool starts per checkout")
    parser.add_argument("--serve", action="store_true", help="time `tandem serve` instead of `tandem pools start`")
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    if not args.target:
        from tandem.models.tiny import make_tiny

        tiny = make_tiny(Path(tempfile.mkdtemp(prefix="pst-tiny-")), seed=0)
        args.target, args.draft, args.dtype = str(tiny.target), str(tiny.draft), "float32"
    flags = ["--target", args.target, "--draft", args.draft, "--dtype", args.dtype, "--threads", "1"]
    checkouts = [os.path.abspath(services) for services in args.services]
    report: dict = {"what": __doc__.split("\n\n")[0], "args": vars(args),
                    "checkouts": {services: {"start_s": []} for services in checkouts}}
    with checkout_heads([] if args.serve else checkouts) as heads:
        for round_ in range(args.rounds):
            for services in checkouts if round_ % 2 == 0 else checkouts[::-1]:
                if args.serve:
                    report["checkouts"][services]["start_s"].append(serve(services, flags))
                    continue
                report["checkouts"][services]["start_s"].append(
                    tandem(services, heads[services], "pools", "start", "--name", f"p{round_}", *flags))
                tandem(services, heads[services], "pools", "stop", "--name", f"p{round_}")
    for entry in report["checkouts"].values():
        entry["median_start_s"] = statistics.median(entry["start_s"])
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["checkouts"], indent=1))


if __name__ == "__main__":
    main()
