"""The CPU decode-attention kernel's start in fresh processes of two installations (two venvs, each with its own
torch) taking turns on one checkout (A B A B A B), for each commit named, with a model store of its own per commit:
seconds until `cpu_attention.ready()` returns (its build, or the load of one), Python's start and torch's import
included. Each installation's first turn builds; before the build directory was named by the installation too,
both shared one directory, and torch's extension builder, whose command names the installation's torch headers and
libraries, rebuilt the kernel at every change of installation.

    python docs/bench/kernel-reuse-v2.py OUT.json --python A/bin/python --python B/bin/python COMMIT ...
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

READY = "from tandem.core import cpu_attention; assert cpu_attention.ready()"


def starts(commit: str, pythons: list[str], turns: int) -> list[float]:
    with tempfile.TemporaryDirectory() as scratch:
        checkout, home = Path(scratch) / "checkout", Path(scratch) / "home"
        subprocess.run(["git", "worktree", "add", "-f", "--detach", str(checkout), commit], check=True,
                       capture_output=True)
        try:
            seconds = []
            for turn in range(turns):
                started = time.perf_counter()
                subprocess.run([pythons[turn % len(pythons)], "-c", READY], check=True,
                               env={"PYTHONPATH": str(checkout / "services"), "PATH": "/usr/bin:/bin",
                                    "TANDEM_HOME": str(home)})
                seconds.append(round(time.perf_counter() - started, 2))
            return seconds
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(checkout)], capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("commits", nargs="+")
    parser.add_argument("--python", action="append", required=True, help="an installation's interpreter (twice)")
    parser.add_argument("--turns", type=int, default=6)
    args = parser.parse_args()
    report = {"turns": "installations in turn, a fresh process each (Python's start and torch's import included)",
              "pythons": args.python,
              "seconds": {commit: starts(commit, args.python, args.turns) for commit in args.commits}}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
