"""How long the `tandem pools` commands that only ask a pool's manager take: `status --json` and a `scale` that
changes nothing, each a fresh `python -m tandem` process against tiny pools on a Ray head of its own, and which of
torch and transformers each imported. `--services DIR` times another checkout's tandem (a worktree of an older
commit): its own CLI against pools it started itself.

    git worktree add /tmp/old f4f3291
    PYTHONPATH=services python docs/bench/pools-cli-v1.py --services /tmp/old/services services --json cli.json
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

from tandem.bench.local_cluster import ray_env, start_checkout_head
from tandem.models.tiny import make_tiny

# Runs the command, then says on stderr what of the model stack it imported (stdout carries the command's output).
CLI = """
import json, sys
from tandem.cli.main import main

code = main(sys.argv[1:])
loaded = sorted({"torch", "transformers"} & {name.split(".")[0] for name in sys.modules})
print("IMPORTED", json.dumps(loaded), file=sys.stderr)
sys.exit(code)
"""
COMMANDS = {"status": ["pools", "status", "--name", "b", "--json"], "scale": ["pools", "scale", "--name", "b", "draft",
                                                                             "1"]}


def tandem(services: str, address: str, args: list[str]) -> tuple[float, list[str]]:
    """One `tandem ARGS` in a fresh interpreter on `services`: its wall time and what it imported."""
    env = ray_env(address) | {"PYTHONPATH": services, "HF_HUB_OFFLINE": "1"}
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-c", CLI, *args], env=env, capture_output=True, text=True, timeout=600)
    seconds = time.monotonic() - began
    if done.returncode:
        raise SystemExit(f"tandem {' '.join(args)} ({services}): {done.stderr[-2000:]}")
    return seconds, json.loads(done.stderr.rsplit("IMPORTED ", 1)[1])


def sitting(services: str, tiny, calls: int) -> dict:
    head, address = start_checkout_head(services)  # the pools' manager and workers run this checkout too
    try:
        began = time.monotonic()
        tandem(services, address, ["pools", "start", "--name", "b", "--target", str(tiny.target), "--draft",
                                   str(tiny.draft), "--dtype", "float32", "--threads", "1"])
        report: dict = {"start_s": round(time.monotonic() - began, 2)}
        for name, args in COMMANDS.items():
            runs = [tandem(services, address, args) for _ in range(calls)]
            report[name] = {"seconds": [round(s, 2) for s, _ in runs],
                            "median_s": round(statistics.median(s for s, _ in runs), 2),
                            "imported": [imported for _, imported in runs]}
        return report
    finally:
        head.terminate()
        head.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", nargs="+", default=["services"],
                        help="tandem checkouts' services/ directories, timed in turn")
    parser.add_argument("--calls", type=int, default=3, help="calls of each command per checkout")
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    tiny = make_tiny(Path(tempfile.mkdtemp(prefix="pcli-tiny-")), seed=0)
    report = {"what": __doc__.split("\n\n")[0], "args": vars(args),
              "checkouts": {services: sitting(os.path.abspath(services), tiny, args.calls)
                            for services in args.services}}
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["checkouts"], indent=1))


if __name__ == "__main__":
    main()
