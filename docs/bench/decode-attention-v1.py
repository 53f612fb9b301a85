"""Decode attention at the 8-row shape the compiled target forward runs (attention-shapes-v1): grouped queries
[8, 2, 6, 128], keys padded to 512, rows holding 201-460 tokens, a boolean mask; torch's flash kernel against two
bf16 matmuls with a softmax and against the math backend, alternated, median microseconds.

    python docs/bench/decode-attention-v1.py
"""
import statistics
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(2)
torch.manual_seed(0)
R, KVH, G, D, L = 8, 2, 6, 128, 512
q = torch.randn(R, KVH, G, D, dtype=torch.bfloat16)
k = torch.randn(R, KVH, L, D, dtype=torch.bfloat16)
v = torch.randn(R, KVH, L, D, dtype=torch.bfloat16)
lens = torch.tensor([201 + 37 * r for r in range(R)])
mask = (torch.arange(L)[None] < lens[:, None])[:, None, None, :]
scale = D ** -0.5
def flash():
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
def matmul():
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    s = s.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.matmul(s.to(v.dtype), v)
def math_backend():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
ref = flash().float()
for f in (matmul, math_backend):
    print(f.__name__, "max abs diff", (f().float() - ref).abs().max().item())
fs = {"flash": flash, "matmul": matmul, "math": math_backend}
t = {n: [] for n in fs}
for i in range(60):
    names = list(fs)[i % 3:] + list(fs)[:i % 3]
    for n in names:
        s0 = time.perf_counter()
        fs[n]()
        t[n].append(time.perf_counter() - s0)
print({n: round(statistics.median(x) * 1e6) for n, x in t.items()}, "us")
