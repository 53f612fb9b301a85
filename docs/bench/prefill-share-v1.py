"""How much of tandem's plain 8-at-once run is the prefill: the plain engine over the compiled bf16 target, the 8
shipped prompts at once (vllm_compare's plain_b8 run), greedy; the time to the first tokens (max_tokens 1, one
forward over every prompt) against the whole 128-token run, two repeats, each forward timed at
`ModelRunner._forward`.

    PYTHONPATH=services python docs/bench/prefill-share-v1.py     # 10 min with inductor's cache kept
"""
import time

import torch

from tandem.bench.prompts import load_prompts
from tandem.core.config import EngineConfig, SamplingParams
from tandem.core.runner import ModelRunner
from tandem.engines.local import build_engine, encode_prompt
from tandem.models.loader import load_model

torch.set_num_threads(2)
target = load_model("qwen2.5-coder-1.5b-instruct", device=torch.device("cpu"), dtype=torch.bfloat16, progress=False,
                    compile=True)
ids = [encode_prompt(target.tokenizer, text, chat=True) for text in load_prompts()][:8]
engine = build_engine(target, None, EngineConfig(calibrate=False), kv_tokens=8 * 1024)
engine.generate([ids[0][:8]], SamplingParams(temperature=0.0, max_tokens=128))
engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=4))
forwards: list[tuple[int, int, int, float]] = []  # rows, widest row, tokens fed, seconds
untimed = ModelRunner._forward


def timed(self, states, news, wants):
    started = time.perf_counter()
    out = untimed(self, states, news, wants)
    forwards.append((len(states), max(map(len, news)), sum(map(len, news)), time.perf_counter() - started))
    return out


ModelRunner._forward = timed
for repeat in range(2):
    for max_tokens in (1, 128):
        forwards.clear()
        started = time.perf_counter()
        results = engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens))
        seconds = time.perf_counter() - started
        print({"repeat": repeat, "max_tokens": max_tokens, "seconds": round(seconds, 3),
               "tokens": sum(len(r.token_ids) for r in results), "forwards": len(forwards),
               "first_forward": {"rows": forwards[0][0], "widest": forwards[0][1], "tokens": forwards[0][2],
                                 "seconds": round(forwards[0][3], 3)},
               "forward_seconds": round(sum(f[3] for f in forwards), 3)}, flush=True)
