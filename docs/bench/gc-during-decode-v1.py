"""Plain batch-1 decode, compiled target: time spent in Python's garbage collector per token, with the heap as it
is after loading and with it frozen (gc.freeze), prompt by prompt alternated in one process.

    PYTHONPATH=services python docs/bench/gc-during-decode-v1.py compile 128     # about 8 min
"""
import gc
import json
import statistics
import sys
import time

import torch

from tandem.bench.prompts import load_prompts
from tandem.core.config import EngineConfig, SamplingParams
from tandem.core.runner import ModelRunner
from tandem.engines.local import build_engine, encode_prompt
from tandem.models.loader import load_model

torch.set_num_threads(2)
compile_ = sys.argv[1] == "compile"
tokens = int(sys.argv[2])
ModelRunner.warm_up = lambda self: 0  # compile only the classes these requests use
target = load_model("qwen2.5-coder-1.5b-instruct", device=torch.device("cpu"), dtype=torch.bfloat16, progress=False,
                    compile=compile_)
engine = build_engine(target, None, EngineConfig(calibrate=False), kv_tokens=8 * 1300)
ids = [encode_prompt(target.tokenizer, t, chat=True) for t in load_prompts()]
engine.generate([ids[0][:8]], SamplingParams(temperature=0.0, max_tokens=8))
engine.generate([ids[1]], SamplingParams(temperature=0.0, max_tokens=8))
spent = {"t": 0.0, "n": [0, 0, 0], "start": 0.0}
def callback(phase, info):
    if phase == "start":
        spent["start"] = time.perf_counter()
    else:
        spent["t"] += time.perf_counter() - spent["start"]
        spent["n"][info["generation"]] += 1
gc.callbacks.append(callback)
print("objects tracked", len(gc.get_objects()), "gc thresholds", gc.get_threshold(), flush=True)
rows = []
for i, p in enumerate(ids):
    for mode in (("default", "frozen") if i % 2 == 0 else ("frozen", "default")):
        gc.unfreeze() if mode == "default" else gc.freeze()
        spent.update(t=0.0, n=[0, 0, 0])
        s = time.perf_counter()
        r = engine.generate([p], SamplingParams(temperature=0.0, max_tokens=tokens))[0]
        wall = time.perf_counter() - s
        n = len(r.token_ids)
        row = {"prompt": i, "mode": mode, "tokens": n, "ms_per_token": round(1e3 * wall / n, 2),
               "gc_ms_per_token": round(1e3 * spent["t"] / n, 3), "collections": list(spent["n"])}
        rows.append(row)
        print(json.dumps(row), flush=True)
by = {m: [r for r in rows if r["mode"] == m] for m in ("default", "frozen")}
ratios = [d["ms_per_token"] / f["ms_per_token"] for d, f in zip(by["default"], by["frozen"], strict=False)]
print(json.dumps({"default_over_frozen_median": round(statistics.median(ratios), 4),
                  "gc_ms_per_token_default": round(statistics.median(r["gc_ms_per_token"] for r in by["default"]), 3),
                  "gc_ms_per_token_frozen": round(statistics.median(r["gc_ms_per_token"] for r in by["frozen"]), 3)}))
