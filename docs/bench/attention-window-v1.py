"""Run: PYTHONPATH=services python docs/bench/attention-window-v1.py qwen2.5-coder-1.5b-instruct 1,8 24
Compiled static forward: attention over the whole buffer (old) vs a window of the reached positions (new), in one
process, alternated; the cache grown to ~1k capacity by a long sequence first (as calibration and long prompts do)."""
import json
import statistics
import sys
import time

import torch

import tandem.core.cuda_graphs as cg
from tandem.core.runner import ModelRunner
from tandem.models.loader import load_model

torch.set_num_threads(2)
name = sys.argv[1]
rows_list = [int(x) for x in sys.argv[2].split(",")]
steps = int(sys.argv[3])
model = load_model(name, device=torch.device("cpu"), dtype=torch.bfloat16, progress=False).model
runner = ModelRunner(model, compile=True, kv_tokens=16 * 1100)
long = runner.state("long")
long.sync(0, [(5 + 3 * i) % 150000 for i in range(1000)])
runner.prefill(long, 1000)
runner.release("long")
print("cache", runner.cache.slots, runner.cache.capacity, runner.cache.margin, flush=True)
ALIGN = cg.WINDOW_ALIGN
out = {"model": name, "capacity": runner.cache.capacity}
for rows in rows_list:
    states = []
    for j in range(rows):
        s = runner.state(f"r{j}")
        ids = [(7 + 13 * i + j) % 150000 for i in range(200 + 37 * j)]
        s.sync(0, ids)
        runner.prefill(s, len(ids))
        states.append(s)
    def step(variant, states=states, rows=rows):
        cg.WINDOW_ALIGN = ALIGN if variant == "window" else 1 << 30
        keeps = [len(s.tokens) for s in states]
        for s, k in zip(states, keeps, strict=False):
            s.sync(k, [(11 * k) % 150000])
        t = time.perf_counter()
        logits = runner.forward_on_device(states, [1] * rows)
        dt = time.perf_counter() - t
        for s, k in zip(states, keeps, strict=False):
            s.sync(k, [])
        return dt, logits
    for v in ("whole", "window", "whole", "window"):
        step(v)
    diff = (step("whole")[1].float() - step("window")[1].float()).abs().max().item()
    ts = {"whole": [], "window": []}
    for i in range(steps):
        for v in (("whole", "window") if i % 2 == 0 else ("window", "whole")):
            ts[v].append(step(v)[0])
    r = {f"{v}_ms": round(1000 * statistics.median(t), 2) for v, t in ts.items()}
    r["window_speedup"] = round(statistics.median(a / b for a, b in zip(ts["whole"], ts["window"], strict=False)), 4)
    r["max_logit_diff"] = diff
    r["compiled"] = runner.graphs.compiled
    out[str(rows)] = r
    print(rows, r, flush=True)
    for j in range(rows):
        runner.release(f"r{j}")
print(json.dumps(out))
