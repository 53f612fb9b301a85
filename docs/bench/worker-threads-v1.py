"""`tandem serve` over Ray with different worker flags (`--arm NAME FLAGS`): seconds from the command's start until
its readiness says SERVING, then `tandem.bench.serving` against it (tok/s at each concurrency, speculation AUTO and
OFF). The arms take turns, their order alternating round by round; one server runs at a time.

    PYTHONPATH=services python docs/bench/worker-threads-v1.py --arm default "" --arm threads2 "--threads 2" \\
        --json worker-threads.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tandem.bench.local_cluster import serve_process


def serve_and_measure(flags: list[str], bench: list[str]) -> dict:
    out = Path(tempfile.mkdtemp(prefix="wt-"))
    with serve_process(flags, out / "serve.err") as (address, start_s):
        subprocess.run([sys.executable, "-m", "tandem.bench.serving", "--address", address, *bench, "--json",
                        str(out / "serving.json")], check=True, timeout=3600,
                       env={k: v for k, v in os.environ.items() if not k.startswith("RAY_")})
        return {"start_s": start_s, "serving": json.loads((out / "serving.json").read_text())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arm", nargs=2, action="append", metavar=("NAME", "FLAGS"), required=True,
                        help="a name and the extra `tandem serve` flags of one arm")
    parser.add_argument("--serve-flags", default="--max-batch 8", help="flags every arm's server gets")
    parser.add_argument("--bench-flags", default="--concurrency 1 8 --max-tokens 32",
                        help="tandem.bench.serving's flags")
    parser.add_argument("--rounds", type=int, default=2, help="servers per arm")
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    arms = {name: shlex.split(args.serve_flags) + shlex.split(flags) for name, flags in args.arm}
    report: dict = {"what": __doc__.split("\n\n")[0], "args": vars(args), "arms": {name: [] for name in arms}}
    for round_ in range(args.rounds):
        for name in list(arms) if round_ % 2 == 0 else list(arms)[::-1]:
            report["arms"][name].append(serve_and_measure(arms[name], shlex.split(args.bench_flags)))
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n")  # kept as it goes: a long run
    report["summary"] = {name: _summary(runs) for name, runs in report["arms"].items()}
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["summary"], indent=1))


def _summary(runs: list[dict]) -> dict:
    """The median start, and each level and mode's tok/s pooled over the servers (tokens / seconds)."""
    pooled: dict[str, dict[str, float]] = {}
    for run in runs:
        for level in run["serving"]["levels"]:
            key = f"{level['speculation']}@{level['concurrency']}"
            entry = pooled.setdefault(key, {"tokens": 0, "seconds": 0.0})
            entry["tokens"] += level["tokens"]
            entry["seconds"] += level["seconds"]
    return {"median_start_s": statistics.median(r["start_s"] for r in runs),
            **{key: round(e["tokens"] / e["seconds"], 2) for key, e in sorted(pooled.items())}}


if __name__ == "__main__":
    main()
