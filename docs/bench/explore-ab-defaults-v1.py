"""Exploring new rows at 8 at once with tandem's defaults, after the deployment has measured its acceptance: the
committed rule (core.round_plan._explored_pay_whole: a never-drafted row that would not draft at the measured
acceptance pays its whole drafter catch-up) against every new row spreading its catch-up over its rounds, as before
the acceptance is measured. Engines as `python -m tandem.bench.at_once --draft-quantization auto` builds them (eager
bf16 pair, the draft as `auto` quantizes it, its whole head): plain, and one AUTO engine per rule, each calibrated on
its own; the 8 shipped prompts at once, 128 tokens, greedy, the engines rotated each repeat. The rule an AUTO engine
plans with is set before each of its runs (through core.round_plan's name for the function). Per engine: tok/s
pooled and per repeat over plain, rounds drafted.

    PYTHONPATH=services python docs/bench/explore-ab-defaults-v1.py REPEATS OUT.json    # 4 repeats: 11 min on CPU-D
"""

from __future__ import annotations

import json
import sys

import torch

import tandem.core.round_plan as round_plan
from tandem.bench.prompts import load_prompts
from tandem.bench.vllm_compare_tandem import batched
from tandem.cli.common import DEFAULT_DRAFT, DEFAULT_TARGET
from tandem.core.config import EngineConfig, SamplingParams
from tandem.engines.local import build_engine, encode_prompt
from tandem.models.loader import load_pair

COMMITTED = round_plan._explored_pay_whole
RULES = {"committed": COMMITTED, "spread": lambda rows, ks, shares, *rest: shares}


def main(repeats: int, out: str) -> None:
    torch.set_num_threads(2)
    draft, target = load_pair(DEFAULT_DRAFT, DEFAULT_TARGET, device=torch.device("cpu"), dtype=torch.bfloat16,
                              progress=False, draft_quantization="auto")
    ids = [encode_prompt(target.tokenizer, text, chat=True) for text in load_prompts(None)[:8]]
    engines = {"plain": (build_engine(target, None, EngineConfig(calibrate=False)), "committed")}
    for rule in RULES:
        engines[f"auto_{rule}"] = (build_engine(target, draft, EngineConfig()), rule)
    for engine, rule in engines.values():
        round_plan._explored_pay_whole = RULES[rule]
        engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=4))
    runs, outputs, names = [], {}, list(engines)
    for repeat in range(repeats):
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            engine, rule = engines[name]
            round_plan._explored_pay_whole = RULES[rule]
            run = batched(engine, ids, 128)
            outputs[name] = run.pop("outputs")
            runs.append({"engine": name, "repeat": repeat, "prior_measured": engine.prior.measured} | run)
            print(name, json.dumps(run), flush=True)
    round_plan._explored_pay_whole = COMMITTED
    report: dict = {"draft_quantization": "auto", "requests_at_once": len(ids), "tokens": 128, "repeats": repeats,
                    "torch": torch.__version__, "runs": runs,
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
    report["spread_vs_committed"] = round(report["auto_spread"]["tok_s"] / report["auto_committed"]["tok_s"], 4)
    with open(out, "w") as sink:
        json.dump(report, sink, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
