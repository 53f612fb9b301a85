"""AUTO at 8 at once with its default k_max (8) against k_max 2 and 1, and plain decoding: whether the batch plan's
width is what AUTO loses at 8 on CPU-A. One process, one target and one draft (compiled, w4, the draft's head cut
to 65536 ids) under four engines, each calibrated and warmed up; the 8 shipped prompts at once, 128 tokens, greedy;
per repeat the engines' order rotated and run forwards then backwards.

    PYTHONPATH=services python docs/bench/auto-cap-ab-v1.py REPEATS OUT.json     # 15 min for 2 repeats on CPU-A
"""

from __future__ import annotations

import json
import sys
import time

import torch

from tandem.bench.prompts import load_prompts
from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.engines.local import build_engine, encode_prompt
from tandem.models.loader import load_pair

CAPS = (8, 2, 1)


def main(repeats: int, out: str) -> None:
    torch.set_num_threads(2)
    draft, target = load_pair("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct",
                              device=torch.device("cpu"), dtype=torch.bfloat16, progress=False, compile="all",
                              draft_quantization="w4")
    ids = [encode_prompt(target.tokenizer, text, chat=True) for text in load_prompts(None)[:8]]
    kv_tokens = 16 * 1024
    engines = {"plain": build_engine(target, None, EngineConfig(calibrate=False), kv_tokens=kv_tokens)}
    for cap in CAPS:
        spec = SpecConfig(draft_vocab=65536, k_max=cap, k_init=min(4, cap))
        engines[f"auto_k{cap}"] = build_engine(target, draft, EngineConfig(spec=spec), kv_tokens=kv_tokens)
    for engine in engines.values():  # untimed: first calls, as the vLLM comparison warms its engines
        engine.generate([ids[0][:8]], SamplingParams(temperature=0.0, max_tokens=128))
        engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=4))
    names = list(engines)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for repeat in range(repeats):
        order = names[repeat % len(names):] + names[:repeat % len(names)]
        for name in order + order[::-1]:
            started = time.perf_counter()
            results = engines[name].generate(ids, SamplingParams(temperature=0.0, max_tokens=128))
            seconds = time.perf_counter() - started
            tokens = sum(len(r.token_ids) for r in results)
            runs[name].append({"s": round(seconds, 3), "tokens": tokens,
                               "drafted": sum(r.stats["drafted"] for r in results),
                               "accepted": sum(r.stats["accepted"] for r in results),
                               "rounds": sum(r.stats["rounds"] for r in results)})
            print(name, runs[name][-1], round(tokens / seconds, 2), flush=True)
    summary = {name: round(sum(r["tokens"] for r in items) / sum(r["s"] for r in items), 3)
               for name, items in runs.items()}
    print(summary)
    with open(out, "w") as sink:
        json.dump({"summary": summary, "runs": runs}, sink, indent=1)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
