"""The batch plan's margin at 8 at once with tandem's defaults: core.batch_plan.plan_batch drafts only where its
priced rate beats plain decoding of the batch by `margin` (0.05). Engines as `python -m tandem.bench.at_once
--draft-quantization auto` builds them (eager bf16 pair, the draft as `auto` quantizes it, its whole head): plain,
and one AUTO engine per margin, each calibrated on its own; the 8 shipped prompts at once, 128 tokens, greedy, the
engines rotated each repeat. The margin an AUTO engine plans with is set before each of its runs (the plan reads it
through core.round_plan's name for plan_batch). Per engine: tok/s pooled and per repeat over plain, rounds drafted.

    PYTHONPATH=services python docs/bench/batch-margin-ab-v1.py REPEATS MARGINS OUT.json   # 0.05,0.0: 9 min on CPU-D
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
from tandem.core.config import EngineConfig, SamplingParams
from tandem.engines.local import build_engine, encode_prompt
from tandem.models.loader import load_pair


def main(repeats: int, margins: list[float], out: str) -> None:
    torch.set_num_threads(2)
    draft, target = load_pair(DEFAULT_DRAFT, DEFAULT_TARGET, device=torch.device("cpu"), dtype=torch.bfloat16,
                              progress=False, draft_quantization="auto")
    ids = [encode_prompt(target.tokenizer, text, chat=True) for text in load_prompts(None)[:8]]
    engines = {"plain": (build_engine(target, None, EngineConfig(calibrate=False)), 0.05)}
    for margin in margins:
        engines[f"auto_m{margin:g}"] = (build_engine(target, draft, EngineConfig()), margin)
    for engine, margin in engines.values():
        round_plan.plan_batch = functools.partial(plan_batch, margin=margin)
        engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=4))
    runs, outputs, names = [], {}, list(engines)
    for repeat in range(repeats):
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            engine, margin = engines[name]
            round_plan.plan_batch = functools.partial(plan_batch, margin=margin)
            run = batched(engine, ids, 128)
            outputs[name] = run.pop("outputs")
            runs.append({"engine": name, "repeat": repeat, "margin": margin} | run)
            print(name, json.dumps(run), flush=True)
    report: dict = {"draft_quantization": "auto", "requests_at_once": len(ids), "tokens": 128, "repeats": repeats,
                    "margins": margins, "torch": torch.__version__, "runs": runs,
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
    main(int(sys.argv[1]), [float(m) for m in sys.argv[2].split(",")], sys.argv[3])
