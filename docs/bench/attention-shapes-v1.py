"""The compiled target forward's sdpa calls at 1 and then 8 rows, with their input shapes (torch's profiler,
shapes recorded, self time a call) and the profiled forward's self total; each row count's slots freed after it.

    PYTHONPATH=services python docs/bench/attention-shapes-v1.py   # 3 min, inductor's cache kept
"""
import torch
from torch.profiler import ProfilerActivity, profile

from tandem.bench.forward_split import _forward, cached_state
from tandem.core.runner import ModelRunner
from tandem.models.loader import load_model

torch.set_num_threads(2)
model = load_model("qwen2.5-coder-1.5b-instruct", device=torch.device("cpu"), dtype=torch.bfloat16,
                   progress=False).model
runner = ModelRunner(model, compile=True)
with torch.inference_mode():
    for rows in (1, 8):
        states = [cached_state(runner, f"p-{rows}-{r}", 200 + 37 * r, offset=r) for r in range(rows)]
        for _ in range(3):
            _forward(runner, states)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            _forward(runner, states)
        for e in prof.key_averages(group_by_input_shape=True):
            if "scaled_dot" in e.key:
                print(rows, e.key, e.count, e.input_shapes, round(e.self_cpu_time_total / e.count), "us")
        tot = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e3
        print(rows, "self total ms", round(tot, 1))
        for r in range(rows):
            runner.release(f"p-{rows}-{r}")
print("capacity", runner.cache.capacity, "slots", runner.cache.slots)
