"""The host work around a compiled one-row forward of the w8a8 draft, before and after three cuts, one process,
alternated. "before" is the draft as it compiled until then: its layers' held weights with symbolic sizes (dynamo's
`mark_static` undone while it loads), inductor's size checks on (compiled without core.cuda_graphs.INDUCTOR_OPTIONS)
and the direct calls reading sizes through dynamo's wrapped helpers (core.guardless's unwrapping undone while it
warms up). "after" is the draft as shipped. Each model loads and warms up as a server's runner does; then each
forward runs `steps` times, the order alternated every step; the graph's own call (inductor's `call`: its kernels
and its wrapper) is timed inside each forward, so `host_ms` is what the forward spends outside it.

    PYTHONPATH=services python docs/bench/host-overhead-v1.py 200 out.json   # 15 min from a cold inductor cache
"""
import gc
import json
import statistics
import sys
import time

import torch
from torch._inductor.output_code import CompiledFxGraph

from tandem.bench.forward_split import _forward, cached_state
from tandem.core import guardless
from tandem.core.cuda_graphs import INDUCTOR_OPTIONS
from tandem.core.runner import ModelRunner
from tandem.models.loader import load_model

torch.set_num_threads(2)
steps, out = int(sys.argv[1]), sys.argv[2]
NAME, QUANTIZATION = "qwen2.5-coder-0.5b-instruct", "w8a8"
report = {"model": NAME, "quantization": QUANTIZATION, "rows": 1, "context": 300, "steps": steps, "threads": 2,
          "dtype": "bfloat16", "inductor_options_after": INDUCTOR_OPTIONS, "variants": {}}
inside = {"seconds": 0.0}


def time_graph_calls() -> None:
    """Time inductor's `call` of every compiled graph loaded so far (idempotent)."""
    for graph in [o for o in gc.get_objects() if type(o) is CompiledFxGraph]:
        call = graph.current_callable
        if getattr(call, "timed", False):
            continue

        def timed(args, call=call):
            started = time.perf_counter()
            try:
                return call(args)
            finally:
                inside["seconds"] += time.perf_counter() - started

        timed.timed = True
        graph.current_callable = timed


runners, states = {}, {}
with torch.inference_mode():
    for variant in ("before", "after"):
        mark_static, unwrapped = torch._dynamo.mark_static, guardless._unwrapped_helpers
        if variant == "before":
            torch._dynamo.mark_static = lambda tensor, index=None: None
            guardless._unwrapped_helpers = lambda globals_, code: globals_
        try:
            model = load_model(NAME, device=torch.device("cpu"), dtype=torch.bfloat16, progress=False,
                               quantization=QUANTIZATION).model
            runner = ModelRunner(model, compile=True)
            if variant == "before":
                runner.graphs.forward = torch.compile(runner.graphs.plain_forward, dynamic=True, fullgraph=True)
            started = time.perf_counter()
            runner.warm_up()
            runners[variant], states[variant] = runner, [cached_state(runner, variant, 300)]
            _forward(runner, states[variant])  # the class of this forward's first call
        finally:
            torch._dynamo.mark_static, guardless._unwrapped_helpers = mark_static, unwrapped
        report["variants"][variant] = {"warm_up_s": round(time.perf_counter() - started, 1)}
    time_graph_calls()
    totals = {variant: [] for variant in runners}
    calls = {variant: [] for variant in runners}
    for step in range(steps):
        order = list(runners)[step % 2:] + list(runners)[: step % 2]
        for variant in order:
            inside["seconds"] = 0.0
            started = time.perf_counter()
            _forward(runners[variant], states[variant])
            totals[variant].append(time.perf_counter() - started)
            calls[variant].append(inside["seconds"])
    for variant, runner in runners.items():
        report["variants"][variant].update({
            "median_ms": round(statistics.median(totals[variant]) * 1e3, 3),
            "graph_call_median_ms": round(statistics.median(calls[variant]) * 1e3, 3),
            "host_median_ms": round(statistics.median(
                t - c for t, c in zip(totals[variant], calls[variant], strict=True)) * 1e3, 3),
            "direct_calls": runner.graphs.guardless.direct_calls, "compiled": runner.graphs.compiled})
    report["before_over_after"] = round(statistics.median(
        b / a for b, a in zip(totals["before"], totals["after"], strict=True)), 4)
    report["graph_call_before_over_after"] = round(statistics.median(
        b / a for b, a in zip(calls["before"], calls["after"], strict=True)), 4)
print(json.dumps(report), flush=True)
with open(out, "w") as sink:
    json.dump(report, sink, indent=1)
