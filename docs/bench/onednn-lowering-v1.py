"""The compiled decode forward at one row, one process, alternated: the packed product through the custom op's Python
kernel (what inductor generated before core.packed_linear.lower_to_onednn) against oneDNN's op called from the
generated code (the lowering). With `w8a8`, the same for the w8a8 draft's int8 GEMM (core.w8a8_linear's lowering; the
packed product's is on in both). Inductor's on-disk graph cache is off, since its key does not see a lowering. Counts
the Python kernel's calls in one forward of each, so the variants are what they say.

    PYTHONPATH=services python docs/bench/onednn-lowering-v1.py qwen2.5-coder-1.5b-instruct 40 out.json        # 4 min
    PYTHONPATH=services python docs/bench/onednn-lowering-v1.py qwen2.5-coder-0.5b-instruct 60 out.json w8a8   # 4 min
"""
import json
import statistics
import sys
import time

import torch
import torch._inductor.config as inductor_config
from torch._inductor.lowering import lowerings

from tandem.bench.forward_split import _forward, cached_state
from tandem.core import packed_linear, w8a8_linear
from tandem.core.runner import ModelRunner
from tandem.models.loader import load_model

torch.set_num_threads(2)
name, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
quantization = sys.argv[4] if len(sys.argv) > 4 else "none"
inductor_config.fx_graph_cache = False
model = load_model(name, device=torch.device("cpu"), dtype=torch.bfloat16, progress=False,
                   quantization=quantization).model
if quantization == "w8a8":
    module, op, kernel_name = w8a8_linear, torch.ops.tandem.onednn_int8_gemm.default, "_gemm"
else:
    module, op, kernel_name = packed_linear, torch.ops.tandem.onednn_linear.default, "_product"


runners, states, firsts, kernel_calls = {}, {}, {}, {}
with torch.inference_mode():
    for variant in ("kernel", "direct"):
        runner = ModelRunner(model, compile=True)  # registers the lowerings (once per process)
        if variant == "kernel":
            lowerings.pop(op, None)
        else:
            module.lower_to_onednn.__wrapped__()
            # another backend object: dynamo compiles anew rather than reuse the first variant's graph
            runner.graphs.forward = torch.compile(runner.graphs.plain_forward, dynamic=True, fullgraph=True,
                                                  options={"max_autotune": False})
        states[variant] = [cached_state(runner, variant, 300)]
        started = time.perf_counter()
        _forward(runner, states[variant])
        firsts[variant] = round(time.perf_counter() - started, 1)
        runners[variant] = runner
    kernel = getattr(module, kernel_name)
    for variant, runner in runners.items():
        count = [0]

        def counted(*args, count=count):
            count[0] += 1
            return kernel(*args)
        setattr(module, kernel_name, counted)
        _forward(runner, states[variant])
        setattr(module, kernel_name, kernel)
        kernel_calls[variant] = count[0]  # the output head runs outside the graph: one call in either
    times = {variant: [] for variant in runners}
    order = list(runners)
    for step in range(steps):
        for variant in order[step % 2:] + order[: step % 2]:
            started = time.perf_counter()
            _forward(runners[variant], states[variant])
            times[variant].append(time.perf_counter() - started)
report = {"model": name, "quantization": quantization, "rows": 1, "context": 300, "steps": steps, "threads": 2,
          "dtype": "bfloat16", "first_forward_s": firsts, "python_kernel_calls_per_forward": kernel_calls,
          "median_ms": {v: round(statistics.median(t) * 1e3, 2) for v, t in times.items()},
          "kernel_over_direct": round(statistics.median(a / b for a, b in zip(times["kernel"], times["direct"],
                                                                               strict=True)), 4),
          "compiled": all(r.graphs.compiled for r in runners.values())}
print(json.dumps(report), flush=True)
with open(out, "w") as sink:
    json.dump(report, sink, indent=1)
