"""The huge whole response of loop-gap-whole-response-v1.py (16 choices echoing a 3000-token prompt with 20 logprobs
a token, the tiny pair, the engine in this process), answered with this process's loaded heap as it is or frozen as
`tandem serve` freezes it once serving (core.gc_pause.freeze_loaded_heap): the longest time between a gRPC client's
health answers, asked every 20 ms, and the collector's runs over 30 ms. With the current code (prompt scores built
with the collector paused, the body encoded in parts), one run in four still met a full collection that walked the
whole heap. Two arms, alternated, `--repeats` each; the frozen arm freezes before its request and unfreezes after.

    PYTHONPATH=services python docs/bench/loop-gap-frozen-heap-v1.py OUT.json [--repeats 6]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
from pathlib import Path

_spec = importlib.util.spec_from_file_location("loop_gap", Path(__file__).with_name("loop-gap-whole-response-v1.py"))
loop_gap = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(loop_gap)  # its request, its served tiny pair, its health loop

from tandem.core.gc_pause import freeze_loaded_heap  # noqa: E402

ARMS = ("heap as loaded", "heap frozen")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    results: dict[str, list] = {arm: [] for arm in ARMS}
    with loop_gap.tiny_server() as (server, collections):
        for repeat in range(args.repeats):
            for arm in ARMS if repeat % 2 == 0 else ARMS[::-1]:
                frozen = freeze_loaded_heap() if arm == "heap frozen" else 0
                results[arm].append((*loop_gap.one(server, collections), frozen))
                gc.unfreeze()
                print(arm, results[arm][-1], flush=True)
    summary = {arm: {"longest_gap_s": max(run[0] for run in runs),
                     "median_longest_gap_s": sorted(run[0] for run in runs)[len(runs) // 2],
                     "runs_with_a_collection_over_30ms": sum(bool(run[2]) for run in runs),
                     "runs": runs}  # (longest gap s, request s, collections over 30 ms, objects frozen)
               for arm, runs in results.items()}
    with open(args.out, "w") as out:
        json.dump({"request": loop_gap.BODY | {"prompt": "3000 tokens"}, "arms": summary}, out, indent=1)
    print(json.dumps({arm: {k: v for k, v in s.items() if k != "runs"} for arm, s in summary.items()}, indent=1))


if __name__ == "__main__":
    main()
