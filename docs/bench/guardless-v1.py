"""Compiled decode forwards with and without dynamo's guard check (core.guardless), one process, alternated. Both
models load and warm up as a server's runners do (each compiles its six shape classes, so the function's cache holds
twelve graphs, as in production); then each model's one-row forward runs `steps` times through its class's code
directly and through torch.compile's guarded callable, the order alternated every step.

    PYTHONPATH=services python docs/bench/guardless-v1.py 60 out.json   # 25 min from a cold inductor cache (CPU-A)
"""
import json
import statistics
import sys
import time

import torch

from tandem.bench.forward_split import _forward, cached_state
from tandem.core.runner import ModelRunner
from tandem.models.loader import load_model

torch.set_num_threads(2)
steps, out = int(sys.argv[1]), sys.argv[2]
MODELS = {"target": ("qwen2.5-coder-1.5b-instruct", "none"), "draft": ("qwen2.5-coder-0.5b-instruct", "w8a8")}
report = {"rows": 1, "context": 300, "steps": steps, "threads": 2, "dtype": "bfloat16", "models": {}}
runners, states = {}, {}
with torch.inference_mode():
    for role, (name, quantization) in MODELS.items():
        model = load_model(name, device=torch.device("cpu"), dtype=torch.bfloat16, progress=False,
                           quantization=quantization).model
        runner = ModelRunner(model, compile=True)
        started = time.perf_counter()
        runner.warm_up()
        report["models"][role] = {"name": name, "quantization": quantization,
                                  "warm_up_s": round(time.perf_counter() - started, 1)}
        runners[role], states[role] = runner, [cached_state(runner, role, 300)]
    for role, runner in runners.items():
        guardless = runner.graphs.guardless
        variants = {"guardless": guardless,
                    "guarded": lambda key, *args, guardless=guardless: guardless.compiled(*args)}
        times = {variant: [] for variant in variants}
        for step in range(steps + 2):
            order = list(variants)[step % 2:] + list(variants)[: step % 2]
            for variant in order:
                runner.graphs.guardless = variants[variant]
                started = time.perf_counter()
                _forward(runner, states[role])
                if step >= 2:  # the first two: each variant's first call of the class
                    times[variant].append(time.perf_counter() - started)
        runner.graphs.guardless = guardless
        report["models"][role].update({
            "median_ms": {v: round(statistics.median(t) * 1e3, 2) for v, t in times.items()},
            "guarded_over_guardless": round(statistics.median(
                a / b for a, b in zip(times["guarded"], times["guardless"], strict=True)), 4),
            "direct_calls": guardless.direct_calls, "compiled": runner.graphs.compiled,
            "graphs_in_cache": len(torch._dynamo.eval_frame._debug_get_cache_entry_list(ModelRunner._hidden))})
print(json.dumps(report), flush=True)
with open(out, "w") as sink:
    json.dump(report, sink, indent=1)
