"""The compiled decode forward at one row, one process, variants alternated: inductor's Python wrapper (the default),
its C++ wrapper (`cpp_wrapper`), and the default graph run under `torch.compiler.set_stance(skip_guard_eval_unsafe=True)`
(dynamo checks only the guards that tell its cached graphs apart).
compiled-overheads-v1.json was taken at cac4b4c, before the oneDNN lowerings (core.packed_linear's and
core.w8a8_linear's lower_to_onednn); compiled-overheads-v2.json (the w8a8 draft) after both;
compiled-overheads-v3.json (the w8a8 draft, `py,cpp`, CPU-A) after core.guardless, each variant calling its graph
without dynamo's guard check.

    PYTHONPATH=services python docs/bench/compiled-overheads-v1.py qwen2.5-coder-1.5b-instruct 30
    PYTHONPATH=services python docs/bench/compiled-overheads-v1.py qwen2.5-coder-0.5b-instruct 60 py,skipguard w8a8
"""  # noqa: E501
import json
import statistics
import sys
import time

import torch

from tandem.bench.forward_split import _forward, cached_state
from tandem.core.runner import ModelRunner
from tandem.models.loader import load_model

torch.set_num_threads(2)
name = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-1.5b-instruct"
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 30
variants = (sys.argv[3] if len(sys.argv) > 3 else "py,cpp,skipguard").split(",")
quant = sys.argv[4] if len(sys.argv) > 4 else "none"
model = load_model(name, device=torch.device("cpu"), dtype=torch.bfloat16, progress=False, quantization=quant).model
runners = {}
for v in variants:
    if v == "skipguard":
        continue
    r = ModelRunner(model, compile=True)
    if v == "cpp":
        r.graphs.forward = torch.compile(r.graphs.plain_forward, dynamic=True, fullgraph=True,
                                         options={"cpp_wrapper": True})
    runners[v] = r
if "skipguard" in variants:
    runners["skipguard"] = runners["py"]
jobs, firsts = {}, {}
with torch.inference_mode():
    for v, r in runners.items():
        states = jobs["py"][1] if v == "skipguard" else [cached_state(r, f"ab-{v}", 300)]
        jobs[v] = (r, states)
    def call(v):
        r, states = jobs[v]
        if v == "skipguard":
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                _forward(r, states)
        else:
            _forward(r, states)
    for v in jobs:
        t = time.perf_counter()
        call(v)
        call(v)
        firsts[v] = time.perf_counter() - t
        print(v, "first", round(firsts[v], 1), "compiled", runners[v].graphs.compiled, runners[v].graphs.compile_error,
              flush=True)
    # logits equal?
    times = {v: [] for v in jobs}
    order = list(jobs)
    for step in range(steps):
        for v in order[step % len(order):] + order[:step % len(order)]:
            t = time.perf_counter()
            call(v)
            times[v].append(time.perf_counter() - t)
res = {v: round(statistics.median(t) * 1e3, 2) for v, t in times.items()}
ratios = {v: round(statistics.median(a / b for a, b in zip(times["py"], times[v], strict=False)), 4) for v in jobs}
print(json.dumps({"median_ms": res, "py_over_variant": ratios, "steps": steps}), flush=True)
