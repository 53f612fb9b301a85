"""Prompt logprobs on the real pair, in process: each of the 8 shipped prompts (chat template applied) followed by
the target's own greedy answer of 96 tokens, scored with prompt_logprobs (5 alternatives) through the speculative
engine (AUTO), against a plain forward of the same loaded model over each prompt alone: the largest difference
of a token's log-probability, and how often the most likely token agrees. Then what scoring costs: the 8 prompts
at once and one at a time, max_tokens 1, with and without prompt_logprobs, in the order without, with, with,
without (seconds per pass, the ratio of the means).

    PYTHONPATH=services python docs/bench/prompt-logprobs-v1.py float32 out.json   # ~3 min on CPU-A (bfloat16: ~2)
"""
import json
import sys
import time

import torch

from tandem.bench.prompts import load_prompts
from tandem.core.config import EngineConfig, SamplingParams
from tandem.engines.local import build_engine, encode_prompt
from tandem.models.loader import load_pair

dtype, out = sys.argv[1], sys.argv[2]
torch.set_num_threads(2)
draft, target = load_pair("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", device=torch.device("cpu"),
                          dtype=getattr(torch, dtype), progress=False)
plain = build_engine(target, None, EngineConfig(calibrate=False), kv_tokens=8192)
auto = build_engine(target, draft, EngineConfig(), kv_tokens=8192)
chats = [encode_prompt(target.tokenizer, p, chat=True) for p in load_prompts()]
answers = plain.generate(chats, SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True))
prompts = [chat + answer.token_ids for chat, answer in zip(chats, answers, strict=True)]

scored = auto.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=5))
rows = []
for prompt, result in zip(prompts, scored, strict=True):
    with torch.inference_mode():
        reference = torch.log_softmax(target.model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    ours = torch.tensor([lp.logprob for lp in result.prompt_logprobs])
    theirs = reference[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    top_ours = [lp.top[0][0] for lp in result.prompt_logprobs]
    top_theirs = reference[:-1].argmax(dim=-1).tolist()
    rows.append({"tokens": len(prompt), "max_abs_diff": float((ours - theirs).abs().max()),
                 "mean_abs_diff": float((ours - theirs).abs().mean()),
                 "top1_agree": sum(a == b for a, b in zip(top_ours, top_theirs, strict=True)),
                 "positions": len(prompt) - 1, "sum_logprob": float(ours.sum()), "sum_reference": float(theirs.sum())})
    print(json.dumps(rows[-1]), flush=True)


def timed(batch: list[list[int]], asked: bool) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1 if asked else None)
    started = time.perf_counter()
    if len(batch) > 1:
        auto.generate(batch, params)
    else:
        for prompt in prompts:
            auto.generate([prompt], params)
    return time.perf_counter() - started


costs = {}
for label, batch in (("8_at_once", prompts), ("one_at_a_time", prompts[:1])):
    seconds = {False: [], True: []}
    for asked in (False, True, True, False):
        seconds[asked].append(round(timed(batch, asked), 3))
    costs[label] = {"without_s": seconds[False], "with_s": seconds[True],
                    "ratio": round(sum(seconds[True]) / sum(seconds[False]), 3)}
    print(label, json.dumps(costs[label]), flush=True)
report = {"dtype": dtype, "prompts": len(prompts), "rows": rows, "costs": costs,
          "max_abs_diff": max(r["max_abs_diff"] for r in rows),
          "top1_agree": sum(r["top1_agree"] for r in rows), "positions": sum(r["positions"] for r in rows)}
with open(out, "w") as f:
    json.dump(report, f, indent=1)
print(json.dumps({k: v for k, v in report.items() if k != "rows"}))
