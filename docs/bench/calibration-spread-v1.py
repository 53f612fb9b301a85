"""How much calibration's prices for a batch's widths vary from one calibration to the next, and with its passes and
context: the engines of the vLLM comparison (tandem.bench.vllm_compare_tandem.build_engines: the pair compiled, w4
draft, the draft's head cut to 65536 ids), core.calibration.calibrate run ROUNDS times per variant on the AUTO
engine's verifier and drafter, the variants rotated each round:
  p3-c32    calibration as the engine runs it: the fastest of 3 passes, 32 cached tokens
  p5-c32    the fastest of 5 passes
  p3-c160   32 cached tokens -> 160, about where an 8-at-once run of the shipped prompts decodes
Per variant and round: the 8-row forward's price at widths 1, 2, 3 and 5 and their ratios to width 1, the draft
step over 8 rows; per variant the spread (min-max) of each ratio.

    PYTHONPATH=services python docs/bench/calibration-spread-v1.py ROUNDS OUT.json     # about 2 min a round on CPU-A
"""

from __future__ import annotations

import json
import sys

import torch

from tandem.bench.prompts import load_prompts
from tandem.bench.vllm_compare_tandem import build_engines, sitting_job
from tandem.core.calibration import calibrate

VARIANTS = {"p3-c32": (3, 32), "p5-c32": (5, 32), "p3-c160": (3, 160)}


def main(rounds: int, out: str) -> None:
    job = sitting_job(load_prompts(None)[:8])
    loaded, engines, _ = build_engines(job)
    engine = engines["auto"]
    spec, names = engine.config.spec, list(VARIANTS)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for round_ in range(rounds):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            passes, context = VARIANTS[name]
            costs = calibrate(engine.verifier, engine.drafter, spec.k_max, spec.k_init, engine.config.max_batch,
                              context=context, passes=passes)
            prices = {w: costs.batch_forward_time(8, w) for w in (1, 2, 3, 5)}
            run = {"rows8_s": {w: round(s, 4) for w, s in prices.items()},
                   "over_width_1": {w: round(s / prices[1], 3) for w, s in prices.items() if w > 1},
                   "draft_step_8_rows_s": round(costs.draft_time(8), 4)}
            runs[name].append(run)
            print(name, json.dumps(run), flush=True)
    spread = {name: {w: [min(r["over_width_1"][w] for r in items), max(r["over_width_1"][w] for r in items)]
                     for w in (2, 3, 5)} for name, items in runs.items()}
    report = {"config": {k: v for k, v in job.items() if k != "texts"} | {"rounds": rounds, "loaded": loaded,
                                                                           "torch": torch.__version__},
              "spread": spread, "runs": runs}
    with open(out, "w") as sink:
        json.dump(report, sink, indent=1)
    print(json.dumps(spread, indent=1))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
