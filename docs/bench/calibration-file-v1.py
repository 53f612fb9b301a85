"""`tandem serve --calibration-file`: seconds from the command's start until readiness says SERVING, with an empty
file (the server calibrates and stores its costs) against the file that start left (it reuses them), in the order
fresh, reused, reused, fresh; one server at a time. Each server then answers 2 greedy streams of 16 tokens, and the
report keeps their token ids and the file's entries after each start (a reused start leaves them as they were).

    PYTHONPATH=services python docs/bench/calibration-file-v1.py --json calibration-file.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

from loadtest.prompts import load_set
from tandem.bench.local_cluster import greedy_streams, serve_process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve-flags", default="--max-batch 8 --dtype float32", help="every server's flags")
    parser.add_argument("--order", default="fresh,reused,reused,fresh", help="the starts, in order")
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="calfile-"))
    costs_file = out / "calibration.json"
    prompts = load_set("chat")[:2]
    runs = []
    for n, arm in enumerate(args.order.split(",")):
        if arm == "fresh":
            costs_file.unlink(missing_ok=True)
        flags = [*shlex.split(args.serve_flags), "--calibration-file", str(costs_file)]
        with serve_process(flags, out / f"serve-{n}.err") as (address, start_s):
            streams = greedy_streams([address], prompts, 16)
        entries = json.loads(costs_file.read_text())["entries"]
        runs.append({"arm": arm, "start_s": start_s, "outputs": streams["outputs"], "tok_s": streams["tok_s"],
                     "measured": [entry["measured"] for entry in entries]})
        print(arm, start_s, file=sys.stderr, flush=True)
    starts = {arm: [run["start_s"] for run in runs if run["arm"] == arm] for arm in ("fresh", "reused")}
    summary = {"start_s": starts, "fresh_over_reused": round(statistics.median(starts["fresh"])
                                                             / statistics.median(starts["reused"]), 2),
               "same_outputs": all(run["outputs"] == runs[0]["outputs"] for run in runs)}
    print(json.dumps(summary))
    Path(args.json).write_text(json.dumps({"args": vars(args), "summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
