"""A cold burst: 8 requests that share a system prompt and tool list (tandem.bench.agent_prompts) arrive together at
an engine that holds nothing, with prefix caching (the first computes the shared prefix, the others copy it) and
without. The real target in bf16, in one process, plain decoding (the draft is beside the point: the prefill is what
differs), a fresh engine per run so nothing is cached before the burst, runs in the order ON OFF OFF ON repeated.
Reports the seconds until every request has its first token and the prompt tokens each reported cached; the first
tokens are compared.

    PYTHONPATH=services python docs/bench/prefix-burst-v1.py 2 docs/bench/prefix-burst-v1.json   # ~5 min on CPU-A
"""
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from tandem.bench.agent_prompts import agent_prompt_ids
from tandem.bench.prompts import load_prompts
from tandem.core.config import EngineConfig, SamplingParams
from tandem.engines.local import build_engine
from tandem.models.loader import load_model

TARGET = "qwen2.5-coder-1.5b-instruct"
repeats, out = int(sys.argv[1]), sys.argv[2]


def burst(target, ids: list[list[int]], cache: bool) -> dict:
    engine = build_engine(target, None, EngineConfig(calibrate=False), prefix_cache=cache)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    started = time.perf_counter()
    results = engine.generate(ids, params)
    return {"mode": "on" if cache else "off", "seconds": round(time.perf_counter() - started, 3),
            "first_tokens": [r.token_ids[0] for r in results],
            "cached_tokens": [r.stats["cached_prompt_tokens"] for r in results]}


torch.set_num_threads(2)
target = load_model(TARGET, device=torch.device("cpu"), dtype=torch.bfloat16, progress=False)
ids = [agent_prompt_ids(target.tokenizer, question) for question in load_prompts()]
burst(target, ids[:2], True)  # warm-up: kernels, allocator
rows = []
for _ in range(repeats):
    for cache in (True, False, False, True):
        rows.append(burst(target, ids, cache))
        print(json.dumps(rows[-1]), flush=True)
on = [r["seconds"] for r in rows if r["mode"] == "on"]
off = [r["seconds"] for r in rows if r["mode"] == "off"]
summary = {"prompt_tokens": [len(i) for i in ids], "on_seconds_mean": round(statistics.mean(on), 3),
           "off_seconds_mean": round(statistics.mean(off), 3),
           "off_over_on": round(statistics.mean(off) / statistics.mean(on), 3),
           "same_first_tokens": sum(r["first_tokens"] == rows[1]["first_tokens"] for r in rows), "runs": len(rows)}
Path(out).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1) + "\n")
print(json.dumps(summary))
