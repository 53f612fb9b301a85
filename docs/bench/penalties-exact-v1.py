"""Penalties stay lossless on the real pair: the 8 shipped chat prompts x 64 tokens, greedy, each penalty setting
decoded plainly and with speculation (AUTO, and k fixed at 4), token ids compared; in float32 (the algorithm's
exactness) and bfloat16 (reported beside: a (k+1)-token verify forward and a one-token forward round differently).

    PYTHONPATH=services python docs/bench/penalties-exact-v1.py float32,bfloat16 penalties-exact.json   # ~25 min
"""
import json
import sys

import torch

from tandem.bench.prompts import load_prompts
from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.engines.local import build_engine, encode_prompt
from tandem.models.loader import load_pair

SETTINGS = {"repetition": {"repetition_penalty": 1.1},
            "openai": {"presence_penalty": 0.5, "frequency_penalty": 0.5},
            "bias": {"logit_bias": ((13, 2.0), (151645, -100.0))}}  # "." raised, <|im_end|> banned
TOKENS = 64


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


dtypes, out = sys.argv[1].split(","), sys.argv[2]
torch.set_num_threads(2)
report = {"prompts": 8, "max_tokens": TOKENS, "settings": SETTINGS, "dtypes": {}}
for dtype in dtypes:
    draft, target = load_pair("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct",
                              device=torch.device("cpu"), dtype=getattr(torch, dtype), progress=False)
    ids = [encode_prompt(target.tokenizer, text, chat=True) for text in load_prompts()]
    engines = {"plain": build_engine(target, None, EngineConfig(calibrate=False), kv_tokens=4096),
               "auto": build_engine(target, draft, EngineConfig(), kv_tokens=4096),
               "k4": build_engine(target, draft, EngineConfig(spec=SpecConfig(adaptive=False, k_init=4),
                                                              calibrate=False), kv_tokens=4096)}
    rows = {}
    for name, fields in SETTINGS.items():
        params = SamplingParams(temperature=0.0, max_tokens=TOKENS, **fields)
        outputs = {mode: [r.token_ids for r in engine.generate(ids, params)] for mode, engine in engines.items()}
        rows[name] = {mode: {"identical": sum(a == b for a, b in zip(outputs[mode], outputs["plain"], strict=True)),
                             "first_difference": [first_difference(a, b) for a, b
                                                  in zip(outputs[mode], outputs["plain"], strict=True)]}
                      for mode in ("auto", "k4")}
        print(dtype, name, {mode: row["identical"] for mode, row in rows[name].items()}, flush=True)
    report["dtypes"][dtype] = rows
    del engines, draft, target
print(json.dumps(report, indent=1))
with open(out, "w") as sink:
    json.dump(report, sink, indent=1)
