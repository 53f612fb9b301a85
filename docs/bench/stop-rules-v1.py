"""The drafter's confidence stop, two rules side by side: one session alone, the real pair as vllm_compare loads it
(bf16 target, w8a8 draft scoring 65536 ids, both compiled), loadtest's 12 lone prompts x 128 tokens, greedy, the
settings' order reversed on every other prompt and repeat; tok/s and ITL percentiles per setting (a step's gap
divided over the tokens it committed, as tandem.bench.lone_itl does).

- token-X: the shipped rule (LocalDrafter's own): a row stops drafting once its latest draft's top probability is
  below X.
- block-X: tried, not kept: a row stops once the product of its block's top probabilities (the draft's own estimate
  that the target accepts the whole block) is below X; patched in here.
- off: plain decoding.

    PYTHONPATH=services python docs/bench/stop-rules-v1.py 2 off,token-0.8,token-0.6,block-0.5,block-0.35 \
        stop-rules.json                                                     # 25 min with inductor's cache kept
"""
import json
import sys

import torch

from tandem.bench.lone_itl import lone_itls, percentile, prompts
from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.core.local import LocalDrafter
from tandem.engines.local import build_engine, encode_prompt
from tandem.models.loader import load_pair


def block_stop(self, rows, tops, budget, step):
    """The block rule in the shape of LocalDrafter's `_stop_unsure`, which it stands in for: the product of each
    row's top probabilities so far in this block stands where the latest one stands."""
    if step == 0:
        self.block_chance = {}
    for i, top in zip(rows, tops, strict=True):
        self.block_chance[i] = self.block_chance.get(i, 1.0) * top
    sure = [budget[i] for i in rows if self.block_chance[i] >= self.confidence]
    reach = max(sure, default=step + 1)
    for i in rows:
        if self.block_chance[i] < self.confidence:
            budget[i] = min(budget[i], reach)


RULES = {"token": LocalDrafter._stop_unsure, "block": block_stop}

repeats, settings, out = int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3]
torch.set_num_threads(2)
draft, target = load_pair("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", device=torch.device("cpu"),
                          dtype=torch.bfloat16, progress=False, compile=True, draft_quantization="w8a8")
auto = build_engine(target, draft, EngineConfig(spec=SpecConfig(draft_vocab=65536)), kv_tokens=8 * 1024)
plain = build_engine(target, None, EngineConfig(calibrate=False), kv_tokens=8 * 1024)
ids = [encode_prompt(target.tokenizer, text, chat=True) for text in prompts()]
for engine in (auto, plain):  # untimed: first calls of every shape class
    engine.generate([ids[0][:8]], SamplingParams(temperature=0.0, max_tokens=128))
    engine.generate(ids[:8], SamplingParams(temperature=0.0, max_tokens=4))
params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
itls = {s: [] for s in settings}
totals = {s: [0, 0.0] for s in settings}
each = {s: [] for s in settings}
for repeat in range(repeats):
    for index, prompt in enumerate(ids):
        for setting in settings[:: 1 if (index + repeat) % 2 == 0 else -1]:
            engine = plain
            if setting != "off":
                rule, value = setting.split("-")
                LocalDrafter._stop_unsure = RULES[rule]
                auto.drafter.confidence = float(value)
                engine = auto
            gaps, tokens, seconds = lone_itls(engine, prompt, params)
            itls[setting] += gaps
            totals[setting][0] += tokens
            totals[setting][1] += seconds
    for setting in settings:
        each[setting].append(round(totals[setting][0] / totals[setting][1], 3))
    print("repeat", repeat, {s: e[-1] for s, e in each.items()}, flush=True)
reference = totals[settings[1] if len(settings) > 1 else settings[0]]  # the ratios' denominator
report = {"prompts": len(ids), "max_tokens": 128, "repeats": repeats, "settings": {
    s: {"tok_s": round(totals[s][0] / totals[s][1], 3), "tok_s_cumulative_by_repeat": each[s],
        "vs_second_setting": round((totals[s][0] / totals[s][1]) / (reference[0] / reference[1]), 4),
        "itl_p50_ms": round(percentile(itls[s], 0.5) * 1e3, 2), "itl_p90_ms": round(percentile(itls[s], 0.9) * 1e3, 2),
        "itl_p99_ms": round(percentile(itls[s], 0.99) * 1e3, 2), "itls": len(itls[s])} for s in settings}}
print(json.dumps(report, indent=1))
with open(out, "w") as sink:
    json.dump(report, sink, indent=1)
