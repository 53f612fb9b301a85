"""What the start-up A/Bs of two checkouts share (load-pair-v1.py, w4-load-v1.py, convert-gguf-v1.py): a probe, Python
source whose last line of output is one JSON object, run in a fresh process with a checkout's services/ as its
PYTHONPATH, the two sides alternated round by round (the old side first in even rounds), and the report of the
runs' medians. Not a benchmark itself: the scripts import it from beside them."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path


def run_probe(probe: str, services: str, *args: str) -> dict:
    """The probe's JSON, run with `services` first on the path (and the model store offline)."""
    done = subprocess.run([sys.executable, "-c", probe, *args],
                          env={"PYTHONPATH": services, "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
                          capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"the probe ({services}) failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def alternate(sides: dict[str, str], probe: str, *args: str, rounds: int) -> dict[str, list[dict]]:
    """Each side's runs of `probe` (sides: "old" and "new", each a services/ directory), progress on stderr."""
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for round_ in range(rounds):
        for side in ("old", "new") if round_ % 2 == 0 else ("new", "old"):
            runs[side].append(run_probe(probe, sides[side], *args))
            print(round_, side, runs[side][-1], file=sys.stderr, flush=True)
    return runs


def write_report(path: str, config: dict, runs: dict[str, list[dict]], keys: tuple[str, ...], ratio: str,
                 ratio_key: str) -> None:
    """The JSON at `path`: the config, the runs, each side's medians of `keys`, and new_over_old_`ratio` (of the
    medians of `ratio_key`); the medians and the ratio also printed."""
    median = {side: {key: round(statistics.median(run[key] for run in values), 3) for key in keys}
              for side, values in runs.items()}
    summary = {"median": median, f"new_over_old_{ratio}": round(median["new"][ratio_key] / median["old"][ratio_key], 3)}
    Path(path).write_text(json.dumps({"config": config, "runs": runs, **summary}, indent=1))
    print(json.dumps(summary))
