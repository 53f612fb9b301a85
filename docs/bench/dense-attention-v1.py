"""Decode attention as the compiled CPU forward could run it, 8 rows of the 1.5B target's shape (2 key/value heads,
6 query heads each, stacked as core/attention.py does): torch's flash kernel over the first L positions of a slot
buffer (a strided view, as Step.window reads it) against two bf16 matmuls and a float32 softmax over the whole
buffer (a dense view: oneDNN's matmul copies a view whose rows are not one block, the flash kernel does not).
Median microseconds per call of one compiled function (dynamic shapes), alternated.

    python docs/bench/dense-attention-v1.py 8 1 272 128,192,256,272
    python docs/bench/dense-attention-v1.py 8 1 528 256,320,512
    python docs/bench/dense-attention-v1.py 8 4 528 256,320,512      # a verify's 4 tokens a row
"""
import statistics
import sys
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(2)
torch.manual_seed(0)
rows, width, buffer = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
windows = [int(x) for x in sys.argv[4].split(",")]
kv_heads, groups, dim = 2, 6, 128
query = torch.randn(rows, kv_heads, groups * width, dim, dtype=torch.bfloat16)
keys = torch.randn(rows, kv_heads, buffer, dim, dtype=torch.bfloat16)
values = torch.randn(rows, kv_heads, buffer, dim, dtype=torch.bfloat16)
scale = dim**-0.5


def attend(query, keys, values, lengths, window, dense: bool):
    k, v = keys[: query.shape[0], :, : window.shape[0]], values[: query.shape[0], :, : window.shape[0]]
    mask = (window[None] < lengths[:, None])[:, None, None, :]
    if dense:
        scores = torch.matmul(query, k.transpose(-1, -2)).float() * scale
        return torch.matmul(scores.masked_fill(~mask, float("-inf")).softmax(-1).to(v.dtype), v)
    return F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale)


compiled = torch.compile(attend, dynamic=True)
lengths = torch.tensor([min(windows) - 20] * rows)
ways = {f"flash_{n}": (lambda n=n: compiled(query, keys, values, lengths, torch.arange(n), False)) for n in windows}
ways[f"dense_{buffer}"] = lambda: compiled(query, keys, values, lengths, torch.arange(buffer), True)
reference = ways[f"flash_{windows[-1]}"]().float()
print("dense against flash, max abs difference:", (ways[f"dense_{buffer}"]().float() - reference).abs().max().item())
times = {name: [] for name in ways}
for round_ in range(30 * len(ways)):
    names = list(ways)[round_ % len(ways):] + list(ways)[: round_ % len(ways)]
    for name in names:
        started = time.perf_counter()
        ways[name]()
        times[name].append(time.perf_counter() - started)
print(rows, width, buffer, {name: round(statistics.median(t) * 1e6) for name, t in times.items()}, "us")
