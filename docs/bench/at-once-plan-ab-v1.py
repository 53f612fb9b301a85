"""Two of the batch plan's choices at 8 at once with tandem's defaults, A/B: its margin (core.batch_plan.plan_batch
drafts only where its priced rate beats plain decoding of the batch by `margin`, 0.05) and how a new row's drafter
catch-up is priced once the deployment has measured its acceptance (core.round_plan._explored_pay_whole: a
never-drafted row that would not draft at that acceptance pays it whole; `spread`: every new row spreads it over its
rounds, as before the acceptance is measured). Engines as `python -m tandem.bench.at_once --draft-quantization
auto` builds them (eager bf16 pair, the draft as `auto` quantizes it, its whole head): plain, and one AUTO engine per
arm, each calibrated on its own; the 8 shipped prompts at once, 128 tokens, greedy, the engines rotated each repeat.
An arm's choices are set before each of its runs, through core.round_plan's names for the two functions. Arms:
`m<margin>` (the committed pricing at that margin), `spread` (the margin 0.05) and `spread-m<margin>`; `k<N>`, a
fixed k of N, for a yardstick. Per engine: tok/s pooled and per repeat over plain, rounds drafted.
(`explore-ab-defaults-v1.json` calls the arm m0.05 `auto_committed`.)

    PYTHONPATH=services python docs/bench/at-once-plan-ab-v1.py 3 m0.05,m0 margin.json        # 9 min on CPU-D
    PYTHONPATH=services python docs/bench/at-once-plan-ab-v1.py 4 m0.05,spread explore.json    # 11 min on CPU-D
"""

from __future__ import annotations

import functools
import json
import sys

import torch

import tandem.core.round_plan as round_plan
from tandem.bench.prompts import load_prompts
from tandem.bench.vllm_compare_tandem import batched
from tandem.cli.common import DEFAULT_DRAFT, DEFAULT_TARGET
from tandem.core.batch_plan import plan_batch
from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.engines.local import build_engine, encode_prompt
from tandem.models.loader import load_pair

COMMITTED = round_plan._explored_pay_whole


def spread(rows, ks, shares, *rest):
    return shares


def choose(arm: str) -> None:
    """Set the plan's margin and catch-up pricing for `arm` (plain's: the committed ones)."""
    spreads = arm.startswith("spread")
    margin = arm.removeprefix("spread").removeprefix("-").removeprefix("m")
    round_plan.plan_batch = functools.partial(plan_batch, margin=float(margin) if margin else 0.05)
    round_plan._explored_pay_whole = spread if spreads else COMMITTED


def main(repeats: int, arms: list[str], out: str) -> None:
    torch.set_num_threads(2)
    draft, target = load_pair(DEFAULT_DRAFT, DEFAULT_TARGET, device=torch.device("cpu"), dtype=torch.bfloat16,
                              progress=False, draft_quantization="auto")
    ids = [encode_prompt(target.tokenizer, text, chat=True) for text in load_prompts(None)[:8]]
    engines = {"plain": (build_engine(target, None, EngineConfig(calibrate=False)), "m0.05")}
    for arm in arms:
        if arm.startswith("k"):  # a fixed k, the yardstick (tandem.bench.at_once --fixed-k)
            fixed = SpecConfig(adaptive=False, k_init=int(arm[1:]), k_max=max(int(arm[1:]), SpecConfig().k_max))
            engines[arm] = (build_engine(target, draft, EngineConfig(spec=fixed)), "m0.05")
        else:
            engines[f"auto_{arm}"] = (build_engine(target, draft, EngineConfig()), arm)
    for engine, arm in engines.values():
        choose(arm)
        engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=4))
    runs, outputs, names = [], {}, list(engines)
    for repeat in range(repeats):
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            engine, arm = engines[name]
            choose(arm)
            run = batched(engine, ids, 128)
            outputs[name] = run.pop("outputs")
            runs.append({"engine": name, "repeat": repeat, "arm": arm, "prior_measured": engine.prior.measured} | run)
            print(name, json.dumps(run), flush=True)
    choose("m0.05")
    report: dict = {"draft_quantization": "auto", "requests_at_once": len(ids), "tokens": 128, "repeats": repeats,
                    "arms": arms, "torch": torch.__version__, "runs": runs,
                    "greedy_identical": {n: sum(a == b for a, b in zip(outputs[n], outputs["plain"], strict=True))
                                         for n in names[1:]}}
    by = {n: [r for r in runs if r["engine"] == n] for n in names}
    for name in names:
        report[name] = {"tok_s": round(sum(r["tokens"] for r in by[name]) / sum(r["seconds"] for r in by[name]), 3),
                        "spec_rounds": sum(r["spec_rounds"] for r in by[name]),
                        "rounds": sum(r["rounds"] for r in by[name])}
    for name in names[1:]:
        report[f"{name}_vs_plain"] = round(report[name]["tok_s"] / report["plain"]["tok_s"], 4)
        report[f"{name}_vs_plain_by_repeat"] = [round(a["tok_s"] / b["tok_s"], 4)
                                                for a, b in zip(by[name], by["plain"], strict=True)]
    with open(out, "w") as sink:
        json.dump(report, sink, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3])
