"""Where a compiled decode forward's time goes, by the profiler's self time: the oneDNN products, attention,
inductor's fused kernels (named, with its kernel profiling on), the compiled graph's own Python wrapper, dynamo's
guard check (its cache lookup) and the rest. Each model in the process, one row (or ROWS rows), 300 cached tokens
each; the forward timed first without the profiler, then `steps` forwards profiled. MODELS: name:quantization
pairs, comma-separated (default: the w8a8 draft and the bf16 target).

    PYTHONPATH=services python docs/bench/forward-profile-v1.py 10 out.json   # 8 min
    PYTHONPATH=services python docs/bench/forward-profile-v1.py 10 out.json 8 qwen2.5-coder-0.5b-instruct:w4
"""
import json
import sys
import time

import torch
import torch._inductor.config as inductor_config
from torch.profiler import ProfilerActivity, profile

from tandem.bench.forward_split import _forward, cached_state
from tandem.core.runner import ModelRunner
from tandem.models.loader import load_model

torch.set_num_threads(2)
steps, out = int(sys.argv[1]), sys.argv[2]
rows = int(sys.argv[3]) if len(sys.argv) > 3 else 1
models = sys.argv[4] if len(sys.argv) > 4 else "qwen2.5-coder-0.5b-instruct:w8a8,qwen2.5-coder-1.5b-instruct:none"
inductor_config.cpp.enable_kernel_profile = True
GROUPS = (("oneDNN products", ("mkldnn::_linear_pointwise", "onednn::qlinear_pointwise")),
          ("int4 products", ("aten::_weight_int4pack_mm_for_cpu",)),
          ("attention (sdpa)", ("aten::_scaled_dot_product_flash_attention_for_cpu",)),
          ("attention (core.cpu_attention)", ("tandem::decode_attention",)),
          ("inductor's fused kernels", ("graph_",)),
          ("compiled graph's Python wrapper", ("## Call CompiledFxGraph",)),
          ("dynamo's guard check", ("TorchDynamo Cache Lookup",)),
          ("dynamo's pregraph bytecode", ("Pregraph bytecode",)))


def profile_model(name: str, quantization: str) -> dict:
    model = load_model(name, device=torch.device("cpu"), dtype=torch.bfloat16, progress=False,
                       quantization=quantization).model
    runner = ModelRunner(model, compile=True)
    with torch.inference_mode():
        states = [cached_state(runner, f"p{row}", 300, offset=row) for row in range(rows)]
        for _ in range(5):
            _forward(runner, states)
        started = time.perf_counter()
        for _ in range(steps):
            _forward(runner, states)
        plain_ms = (time.perf_counter() - started) / steps * 1e3
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                _forward(runner, states)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / steps / 1e3
    groups = {label: round(sum(e.self_cpu_time_total for e in events if e.key.startswith(prefixes)) / steps / 1e3, 3)
              for label, prefixes in GROUPS}
    groups["the rest"] = round(total - sum(groups.values()), 3)
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:25]
    return {"model": name, "quantization": quantization, "forward_ms_unprofiled": round(plain_ms, 2),
            "self_ms_per_forward_profiled": round(total, 2), "groups_ms_per_forward": groups,
            "top": [{"name": e.key[:90], "calls_per_forward": e.count / steps,
                     "self_ms_per_forward": round(e.self_cpu_time_total / steps / 1e3, 3)} for e in top],
            "compiled": runner.graphs.compiled}


report = {"rows": rows, "context": 300, "steps": steps, "threads": 2, "dtype": "bfloat16",
          "models": [profile_model(*spec.split(":")) for spec in models.split(",")]}
print(json.dumps(report, indent=1), flush=True)
with open(out, "w") as sink:
    json.dump(report, sink, indent=1)
