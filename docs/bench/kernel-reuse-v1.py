"""The CPU decode-attention kernel's start in a fresh process from two checkouts of one commit, taken in turn
(A B A B), for each commit named: seconds until `cpu_attention.ready()` returns (its build, or the load of one).
Before 7a2f3fc the build folder was named by torch's version alone and compiled the checkout's own source, so each
change of checkout rebuilt it.

    python docs/bench/kernel-reuse-v1.py OUT.json COMMIT ...    # about 1.5 min a commit that rebuilds
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

READY = "from tandem.core import cpu_attention; assert cpu_attention.ready()"


def starts(commit: str, turns: int = 4) -> list[float]:
    with tempfile.TemporaryDirectory() as scratch:
        checkouts = [Path(scratch) / name for name in ("a", "b")]
        for checkout in checkouts:
            subprocess.run(["git", "worktree", "add", "-f", "--detach", str(checkout), commit], check=True,
                           capture_output=True)
        try:
            subprocess.run([sys.executable, "-c", READY], check=True, env={"PYTHONPATH": str(checkouts[0] / "services"),
                           "PATH": "/usr/bin:/bin"})  # a first build of this commit's source, untimed
            seconds = []
            for turn in range(turns):
                started = time.perf_counter()
                subprocess.run([sys.executable, "-c", READY], check=True,
                               env={"PYTHONPATH": str(checkouts[turn % 2] / "services"), "PATH": "/usr/bin:/bin"})
                seconds.append(round(time.perf_counter() - started, 2))
            return seconds
        finally:
            for checkout in checkouts:
                subprocess.run(["git", "worktree", "remove", "--force", str(checkout)], capture_output=True)


def main() -> None:
    out, commits = sys.argv[1], sys.argv[2:]
    report = {"turns": "A B A B, a fresh process each (Python's start and torch's import included)",
              "seconds": {commit: starts(commit) for commit in commits}}
    Path(out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
