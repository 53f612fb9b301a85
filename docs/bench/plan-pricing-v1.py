"""The batch plan pricing uneven rounds as the target lays them out (packed on a CPU) against pricing them padded,
8 requests at once, one process, the real pair (bf16 target, w8a8 draft, 2 threads):
- one AUTO engine, calibrated once; per run its cost model either carries the target's RowLayout (packed pricing,
  the current code) or none (every round priced padded, the code before), and a plain engine beside them;
- "greedy": the 8 shipped prompts, greedy (rows of like acceptance);
- "mixed": the same prompts, 4 greedy and 4 sampled at temperature 1.0 with seeds (rows of unlike acceptance).
Each repeat runs every arm over both cases, the order reversed every other repeat. One JSON out.
Run: PYTHONPATH=services python docs/bench/plan-pricing-v1.py REPEATS OUT.json"""
import json
import os
import statistics
import sys
import time

import torch

torch.set_num_threads(2)
from tandem.bench.prompts import load_prompts  # noqa: E402
from tandem.core.config import EngineConfig, SamplingParams  # noqa: E402
from tandem.engines.local import build_engine, encode_prompt  # noqa: E402
from tandem.models.loader import load_pair  # noqa: E402

draft, target = load_pair("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", device=torch.device("cpu"),
                          dtype=torch.bfloat16, progress=False, draft_quantization="w8a8")
ids = [encode_prompt(target.tokenizer, t, chat=True) for t in load_prompts()[:8]]
plain = build_engine(target, None, EngineConfig(calibrate=False))
auto = build_engine(target, draft, EngineConfig())
layout = auto.costs.layout
calibrated = auto.costs.to_dict()
greedy = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
CASES = {"greedy": [greedy] * 8,
         "mixed": [greedy if i % 2 == 0 else SamplingParams(temperature=1.0, max_tokens=128, ignore_eos=True, seed=i)
                   for i in range(8)]}
ARMS = ("plain", "auto_padded_pricing", "auto_packed_pricing")

def run(arm, params):
    engine = plain if arm == "plain" else auto
    auto.costs.layout = layout if arm == "auto_packed_pricing" else None
    started = time.perf_counter()
    results = engine.generate(ids, params)
    seconds = time.perf_counter() - started
    tokens = sum(len(r.token_ids) for r in results)
    stats = {key: sum(r.stats[key] for r in results) for key in ("rounds", "spec_rounds", "drafted", "accepted")}
    return {"tok_s": round(tokens / seconds, 3), "seconds": round(seconds, 3), "tokens": tokens,
            "loadavg_1m": round(os.getloadavg()[0], 2)} | stats, [list(r.token_ids) for r in results]

for arm in ARMS:  # warm-up, untimed
    run(arm, [SamplingParams(temperature=0.0, max_tokens=8)] * 8)
runs, outputs = [], {}
for rep in range(int(sys.argv[1])):
    for arm in ARMS if rep % 2 == 0 else ARMS[::-1]:
        for case, params in CASES.items():
            result, tokens = run(arm, params)
            outputs[(case, arm)] = tokens
            runs.append({"repeat": rep, "arm": arm, "case": case} | result)
            print(runs[-1], flush=True)
auto.costs.layout = layout
summary = {}
for case in CASES:
    rates = {arm: [r["tok_s"] for r in runs if r["arm"] == arm and r["case"] == case] for arm in ARMS}
    summary[case] = {"median_tok_s": {arm: statistics.median(v) for arm, v in rates.items()},
                     "packed_over_padded_per_repeat": [round(a / b, 3) for a, b in
                                                        zip(rates["auto_packed_pricing"], rates["auto_padded_pricing"],
                                                            strict=False)],
                     "drafted": {arm: [r["drafted"] for r in runs if r["arm"] == arm and r["case"] == case]
                                 for arm in ARMS[1:]},
                     "same_tokens_as_plain": {arm: sum(a == b for a, b in zip(outputs[(case, arm)],
                                                                               outputs[(case, "plain")], strict=False))
                                              for arm in ARMS[1:]}}
report = {"what": __doc__, "machine": "CPU-A (2 vCPU AMD EPYC, AVX512-BF16, no AMX)", "torch_threads": 2,
          "calibrated_costs": calibrated, "costs_after": auto.costs.to_dict(), "runs": runs, "summary": summary}
with open(sys.argv[2], "w") as fh:
    json.dump(report, fh, indent=1)
print(json.dumps(summary, indent=1))
