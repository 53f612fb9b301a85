"""Host time of one round's plan (core.round_plan.plan_round) at 8 rows, with each batched forward's and draft step's
price worked out once per plan (core.batch_plan.Prices) or asked of the cost model every time, alternated. The costs
are CPU-A's stored calibration of the real pair at 16 rows a step (2026-12-07, before the kernel's DOT path: its
shape is what matters here, 4 widths a row count and 4 draft row counts); three batches: rows that never drafted and
are far behind their drafters, with the deployment's acceptance measured or not, and rows that have drafted.

    PYTHONPATH=services python docs/bench/plan-prices-v1.py OUT.json [--plans 300] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from unittest import mock

from tandem.core import batch_plan, policy, round_plan
from tandem.core.config import SpecConfig
from tandem.core.costs import CostModel
from tandem.core.round_plan import RowView, plan_round

CALIBRATION = {  # ~/.cache/tandem/calibration.json's entry, rounded to 10 us
    "draft_step": 0.02539,
    "verify": {"1": 0.12, "2": 0.12262, "3": 0.12262, "4": 0.12271, "5": 0.12542, "6": 0.12713, "7": 0.14197,
               "8": 0.15052, "9": 0.16549},
    "draft_rows": {"2": 0.04543, "4": 0.04543, "8": 0.05195, "16": 0.06495},
    "batched": {"2x1": 0.1214, "2x2": 0.12725, "2x3": 0.1275, "2x5": 0.17811, "4x1": 0.12482, "4x2": 0.15453,
                "4x3": 0.22003, "4x5": 0.34322, "8x1": 0.1585, "8x2": 0.29433, "8x3": 0.40946, "8x5": 0.63896,
                "16x1": 0.27785, "16x2": 0.52433, "16x3": 0.7737, "16x5": 1.23987},
    "draft_forward": {"4": 0.02414, "8": 0.02441, "16": 0.02441, "32": 0.02449},
}


def batch(behind: int, drafted: bool) -> list[RowView]:
    rows = []
    for _ in range(8):
        state = policy.PolicyState(accepted=5.0, rejected=1.0) if drafted else policy.PolicyState()
        rows.append(RowView(policy=state, max_k=None, remaining=100, prefill_limit=0, first_round=False,
                            behind=behind))
    return rows


def ms_a_plan(rows: list[RowView], measured: bool, costs: CostModel, spec: SpecConfig, plans: int) -> float:
    started = time.perf_counter()
    for _ in range(plans):
        plan_round(rows, True, spec, costs, 0.85, measured)
    return (time.perf_counter() - started) / plans * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--plans", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    costs, spec = CostModel.from_dict(CALIBRATION), SpecConfig()
    cases = {"never drafted, 60 behind, acceptance measured": (batch(60, False), True),
             "never drafted, 60 behind, acceptance not measured": (batch(60, False), False),
             "drafted, 1 behind": (batch(1, True), True)}
    unpriced = mock.patch.multiple(round_plan, prices=lambda costs: costs), mock.patch.multiple(
        batch_plan, prices=lambda costs: costs)
    report: dict = {"rows": 8, "plans_a_timing": args.plans, "cases": {}}
    for name, (rows, measured) in cases.items():
        plans = {arm: round_plan.plan_round(rows, True, spec, costs, 0.85, measured).ks for arm in ("priced",)}
        times: dict[str, list[float]] = {"model asked each time": [], "prices once a plan": []}
        for repeat in range(args.repeats):
            for arm in (list(times) if repeat % 2 == 0 else list(reversed(times))):
                if arm == "model asked each time":
                    with unpriced[0], unpriced[1]:
                        plans["unpriced"] = plan_round(rows, True, spec, costs, 0.85, measured).ks
                        times[arm].append(ms_a_plan(rows, measured, costs, spec, args.plans))
                else:
                    times[arm].append(ms_a_plan(rows, measured, costs, spec, args.plans))
        assert plans["unpriced"] == plans["priced"], "the same plan either way"
        medians = {arm: round(statistics.median(values), 3) for arm, values in times.items()}
        report["cases"][name] = {"ks": list(plans["priced"]), "median_ms": medians,
                                 "speedup": round(medians["model asked each time"] / medians["prices once a plan"], 2),
                                 "ms_each": {arm: [round(v, 3) for v in values] for arm, values in times.items()}}
        print(name, report["cases"][name]["median_ms"], report["cases"][name]["speedup"], flush=True)
    with open(args.out, "w") as out:
        json.dump(report, out, indent=1)


if __name__ == "__main__":
    main()
