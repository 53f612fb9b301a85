"""What the round plan costs per call for a row with prompt lookup at a copying pace, one services tree against
another (each in a process of its own, the trees alternated A B B A per round): the host-side price of rule 0's
weighing of a copy against the draft model's widths 1 to k_max, rule 2's pace test at each.

Three single-row cases, each planned CALLS times per round: a weak copy at a copying pace (the draft model's widths
all asked), a strong copy (the same), and a round with no copy on offer (the policy decides, its k asked once).

    PYTHONPATH=services python docs/bench/lookup-plan-time-v1.py ROUNDS OUT.json NAME=SERVICES_DIR ...   # 1 min
"""

from __future__ import annotations

import json
import pathlib
import statistics
import subprocess
import sys

CALLS = 20000

MEASURE = r"""
import dataclasses, json, sys, time
from tandem.core import policy
from tandem.core.config import SpecConfig
from tandem.core.costs import CostModel
from tandem.core.round_plan import RowView, plan_round

spec = SpecConfig(prompt_lookup=True)
costs = CostModel(draft_step=0.1, verify={w: 1.0 for w in range(1, 10)}, frozen=True)
row = RowView(policy.PolicyState(k=4, accepted=40.0, rejected=4.0), None, 100, 0, False, behind=1, pace=10.0)
cases = {"weak_copy": dataclasses.replace(row, predicted=8, prediction_acceptance=0.4),
         "strong_copy": dataclasses.replace(row, predicted=8, prediction_acceptance=0.9),
         "no_copy": row}
out = {}
for name, case in cases.items():
    rows = [case]
    plan_round(rows, True, spec, costs, 0.9)
    started = time.perf_counter()
    for _ in range(int(sys.argv[1])):
        plan = plan_round(rows, True, spec, costs, 0.9)
    out[name] = {"us_per_call": (time.perf_counter() - started) / int(sys.argv[1]) * 1e6, "ks": list(plan.ks),
                 "from_copy": plan.from_prediction(0)}
print(json.dumps(out))
"""


def run(services: str) -> dict:
    done = subprocess.run([sys.executable, "-c", MEASURE, str(CALLS)], env={"PYTHONPATH": services},
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def main(rounds: int, out: str, trees: dict[str, str]) -> None:
    names = list(trees)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for step in range(rounds):
        order = names if step % 2 == 0 else names[::-1]
        for name in order:
            runs[name].append(run(trees[name]))
    cases = list(runs[names[0]][0])
    report = {"calls_per_run": CALLS, "rounds": rounds, "trees": trees, "runs": runs, "median_us": {}, "plans_equal":
              all(run_a[case]["ks"] == run_b[case]["ks"] and run_a[case]["from_copy"] == run_b[case]["from_copy"]
                  for run_a, run_b in zip(runs[names[0]], runs[names[-1]], strict=True) for case in cases)}
    for name in names:
        report["median_us"][name] = {case: statistics.median(r[case]["us_per_call"] for r in runs[name])
                                     for case in cases}
    if len(names) == 2:
        first, second = names
        report[f"{second}_over_{first}"] = {
            case: statistics.median(b[case]["us_per_call"] / a[case]["us_per_call"]
                                    for a, b in zip(runs[first], runs[second], strict=True)) for case in cases}
    pathlib.Path(out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], dict(arg.split("=", 1) for arg in sys.argv[3:]))
