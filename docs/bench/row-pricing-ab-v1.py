"""The batch plan's prices for a batch as its compiled runner runs it, A/B at 8 at once: the engines of the vLLM
comparison (tandem.bench.vllm_compare_tandem.build_engines: the pair compiled, w4 draft, the draft's head cut to
65536 ids, calibrated and warmed up), the 8 shipped prompts at once, 128 tokens, greedy. Three modes, in the order
A B C C B A, rotated each repeat:
  plain    the plain engine
  before   AUTO priced as before: a table per row count (a row count timed at one width priced wider along the
           single-sequence curve), rows of different widths priced packed
  after    AUTO priced as core.costs and core.row_layout do now: a compiled runner's batch timed and priced as its
           row bucket (7 rows as 8), rows of different widths up to 16 tokens priced padded, a row count timed at one
           width priced wider as the row counts around it grow
Each AUTO mode keeps a cost model of its own, from calibration's on, carried from its run to its next as a serving
engine's is, so neither inherits what the other observed. With `seeded`, both start as an engine does once a batch
down to 7 rows has run one plain round (a 7-row one-token forward observed at 0.97x the 8-row one, as one served
table held it). Per mode: tok/s pooled over its runs, and per run the target's forwards by rows and padded width.

    PYTHONPATH=services python docs/bench/row-pricing-ab-v1.py REPEATS OUT.json [seeded]   # about 3 min a repeat
"""

from __future__ import annotations

import copy
import json
import sys
import time
from collections import Counter

import torch

from tandem.bench.prompts import load_prompts
from tandem.bench.vllm_compare_tandem import build_engines, sitting_job
from tandem.core.config import SamplingParams
from tandem.core.costs import MEASURED_FIELDS, CostModel
from tandem.core.row_layout import RowLayout

GROWTH = CostModel._width_growth


def single_sequence_growth(self: CostModel, rows: int, only: int, width: int) -> float:
    return self.forward_time(rows * width) / self.forward_time(rows * only)


def run(engine, ids: list[list[int]]) -> dict:
    runner = engine.verifier.runner
    shapes: Counter = Counter()
    inner = runner.forward_on_device

    def counted(states, wants):
        shapes[f"rows{len(states)}_width{max(len(s.pending) for s in states)}"] += 1
        return inner(states, wants)

    runner.forward_on_device = counted
    try:
        started = time.perf_counter()
        results = engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=128))
        seconds = time.perf_counter() - started
    finally:
        del runner.forward_on_device  # the class's method again
    tokens = sum(len(r.token_ids) for r in results)
    return {"seconds": round(seconds, 3), "tokens": tokens, "tok_s": round(tokens / seconds, 3),
            "drafted": sum(r.stats["drafted"] for r in results),
            "shapes": dict(sorted(shapes.items(), key=lambda kv: -kv[1]))}


def main(repeats: int, out: str, seeded: bool) -> None:
    texts = load_prompts(None)[:8]
    job = sitting_job(texts)
    loaded, engines, ids = build_engines(job)
    costs = engines["auto"].costs
    now = costs.layout
    layouts = {"before": RowLayout(now.device_type, now.can_pack), "after": now}
    growths = {"before": single_sequence_growth, "after": GROWTH}
    calibrated = {name: copy.deepcopy(getattr(costs, name)) for name in MEASURED_FIELDS}
    kept = {mode: copy.deepcopy(calibrated) for mode in layouts}
    runs: dict[str, list[dict]] = {"plain": [], "before": [], "after": []}
    for mode in layouts:
        for name, value in kept[mode].items():
            setattr(costs, name, value)
        costs.layout = layouts[mode]
        if seeded:
            costs.observe_verify(1, 0.97 * costs.batched[8, 1], rows=7)
    modes = list(runs)
    for repeat in range(repeats):
        first = modes[repeat % 3:] + modes[:repeat % 3]
        for mode in first + first[::-1]:
            if mode != "plain":
                for name, value in kept[mode].items():
                    setattr(costs, name, value)
                costs.layout, CostModel._width_growth = layouts[mode], growths[mode]
            result = run(engines["plain" if mode == "plain" else "auto"], ids)
            costs.layout, CostModel._width_growth = now, GROWTH
            if mode != "plain":
                kept[mode] = {name: getattr(costs, name) for name in MEASURED_FIELDS}
                table = sorted(kept[mode]["batched"].items())
                result["batched_7_8_rows"] = {f"{r}x{w}": round(s, 4) for (r, w), s in table if r in (7, 8)}
            runs[mode].append(result)
            print(mode, json.dumps(result), flush=True)
    summary = {}
    for mode, items in runs.items():
        tokens, seconds = sum(r["tokens"] for r in items), sum(r["seconds"] for r in items)
        summary[mode] = {"tokens": tokens, "seconds": round(seconds, 3), "tok_s": round(tokens / seconds, 3),
                         "tok_s_each": [r["tok_s"] for r in items]}
    summary["after_over_before"] = round(summary["after"]["tok_s"] / summary["before"]["tok_s"], 4)
    summary["after_over_plain"] = round(summary["after"]["tok_s"] / summary["plain"]["tok_s"], 4)
    summary["before_over_plain"] = round(summary["before"]["tok_s"] / summary["plain"]["tok_s"], 4)
    report = {"config": {**{k: v for k, v in job.items() if k != "texts"}, "repeats": repeats, "seeded": seeded,
                         "torch": torch.__version__, "loaded": loaded,
                         "calibrated": CostModel(**calibrated).to_dict(),
                         "kept": {mode: CostModel(**tables).to_dict() for mode, tables in kept.items()}},
              "summary": summary, "runs": runs}
    with open(out, "w") as sink:
        json.dump(report, sink, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3:] == ["seeded"])
