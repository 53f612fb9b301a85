"""Where 8 at once spends its time with tandem's defaults, plain against AUTO against a fixed k: the engines of
`python -m tandem.bench.at_once --draft-quantization auto --fixed-k K` (eager bf16 pair, the draft as `auto`
quantizes it, its whole head; AUTO calibrated as an engine calibrates), the 8 shipped prompts at once, 128 tokens,
greedy, the engines rotated each repeat. Each runner's forwards are timed by shape (rows, widest row's new tokens)
with a wall-clock wrapper, so the report sets what a shape cost in the runs beside what the AUTO engine's cost model
priced it at (before the runs and after them): the prices the batch plan chose by.

    PYTHONPATH=services python docs/bench/at-once-split-v1.py REPEATS K OUT.json     # 2 repeats: 10 min on CPU-D
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict

import torch

from tandem.bench.prompts import load_prompts
from tandem.bench.vllm_compare_tandem import batched
from tandem.cli.common import DEFAULT_DRAFT, DEFAULT_TARGET
from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.core.costs import CostModel
from tandem.engines.local import build_engine, encode_prompt
from tandem.models.loader import load_pair


def shapes_timed(runner, table: dict) -> None:
    """Shadow runner._forward with a wrapper adding each call's wall time to table[(rows, width)]."""
    inner = runner._forward

    def call(states, news, wants, *args, **kwargs):
        started = time.perf_counter()
        out = inner(states, news, wants, *args, **kwargs)
        table[(len(states), max(len(new) for new in news))].append(time.perf_counter() - started)
        return out
    runner._forward = call


def priced(costs, target: dict, draft: dict) -> dict:
    return {"target": {f"{r}x{w}": round(costs.batch_forward_time(r, w), 4) for r, w in sorted(target)},
            "draft_step": {str(r): round(costs.draft_time(r), 4) for r, w in sorted(draft) if w == 1}}


def main(repeats: int, k: int, out: str) -> None:
    torch.set_num_threads(2)
    draft, target = load_pair(DEFAULT_DRAFT, DEFAULT_TARGET, device=torch.device("cpu"), dtype=torch.bfloat16,
                              progress=False, draft_quantization="auto")
    ids = [encode_prompt(target.tokenizer, text, chat=True) for text in load_prompts(None)[:8]]
    fixed = SpecConfig(adaptive=False, k_init=k, k_max=max(k, SpecConfig().k_max))
    engines = {"plain": build_engine(target, None, EngineConfig(calibrate=False)),
               "auto": build_engine(target, draft, EngineConfig()),
               f"k{k}": build_engine(target, draft, EngineConfig(spec=fixed))}
    calibrated = engines["auto"].costs.to_dict()
    for engine in engines.values():
        engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=4))
    timings: dict[str, dict] = {name: {"target": defaultdict(list), "draft": defaultdict(list)} for name in engines}
    for name, engine in engines.items():
        shapes_timed(engine.verifier.runner, timings[name]["target"])
        if engine.drafter is not None:
            shapes_timed(engine.drafter.runner, timings[name]["draft"])
    runs = []
    names = list(engines)
    for repeat in range(repeats):
        for name in names[repeat % 3:] + names[:repeat % 3]:
            run = batched(engines[name], ids, 128)
            run.pop("outputs")
            runs.append({"engine": name, "repeat": repeat} | run)
            print(name, json.dumps(run), flush=True)
    report: dict = {"draft_quantization": "auto", "requests_at_once": len(ids), "tokens": 128, "k": k,
                    "calibrated_costs": calibrated, "costs_after": engines["auto"].costs.to_dict(), "runs": runs}
    for name in engines:
        mine = [r for r in runs if r["engine"] == name]
        seconds = sum(r["seconds"] for r in mine)
        t, d = timings[name]["target"], timings[name]["draft"]
        report[name] = {
            "tok_s": round(sum(r["tokens"] for r in mine) / seconds, 3), "seconds": round(seconds, 3),
            "target_forward_share": round(sum(map(sum, t.values())) / seconds, 4),
            "draft_forward_share": round(sum(map(sum, d.values())) / seconds, 4),
            "target_shapes": {f"{r}x{w}": {"calls": len(v), "mean_s": round(sum(v) / len(v), 4),
                                           "median_s": round(sorted(v)[len(v) // 2], 4)}
                              for (r, w), v in sorted(t.items())},
            "draft_shapes": {f"{r}x{w}": {"calls": len(v), "mean_s": round(sum(v) / len(v), 4),
                                          "median_s": round(sorted(v)[len(v) // 2], 4)}
                             for (r, w), v in sorted(d.items())}}
    every_target = {s for name in engines for s in timings[name]["target"]}
    every_draft = {s for name in engines for s in timings[name]["draft"]}
    for when, table in (("priced_before", calibrated), ("priced_after", report["costs_after"])):
        costs = CostModel.from_dict(table)
        costs.layout = engines["auto"].costs.layout
        report[when] = priced(costs, every_target, every_draft)
    for name in names[1:]:
        report[f"{name}_vs_plain"] = round(report[name]["tok_s"] / report["plain"]["tok_s"], 3)
    with open(out, "w") as sink:
        json.dump(report, sink, indent=1)
    print(json.dumps({n: report[n] for n in names} | {"priced_before": report["priced_before"]}, indent=1))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
