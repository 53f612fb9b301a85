"""Greedy choices of an 8-row step over the target's 151,936-id bf16 logits: one max per row (as verification chose
them) against one max over the step, and argmax and a float32 max beside them; median microseconds, alternated.

    python docs/bench/greedy-choice-v1.py
"""
import statistics
import time

import torch

torch.set_num_threads(2)
logits = torch.randn(8, 151936, dtype=torch.bfloat16)
ways = {"per_row": lambda: [logits[i : i + 1].max(-1).indices for i in range(8)],
        "one_max": lambda: logits.max(-1).indices,
        "argmax": lambda: logits.argmax(-1),
        "float32_max": lambda: logits.float().max(-1).indices}
assert all(torch.equal(torch.cat(ways["per_row"]()), way()) for name, way in ways.items() if name != "per_row")
times = {name: [] for name in ways}
for round_ in range(300):
    names = list(ways)[round_ % 4:] + list(ways)[: round_ % 4]
    for name in names:
        started = time.perf_counter()
        ways[name]()
        times[name].append(time.perf_counter() - started)
print({name: round(statistics.median(t) * 1e6) for name, t in times.items()}, "us")
