"""Every product of the 1.5B target (random bf16 weights of the real shapes) through torch's oneDNN call and through
vLLM's ops.onednn_mm, alternated, in vLLM's venv; argument: rows (M). Prints the median step of each and the ratio."""
import sys
import time

import torch
from vllm import _custom_ops as ops

torch.set_num_threads(2)
torch.manual_seed(0)
H, I, KV, V, L = 1536, 8960, 256, 151936, 28  # noqa: E741
shapes = []
for _ in range(L):
    shapes += [(H + 2 * KV, H), (H, H), (2 * I, H), (H, I)]
shapes.append((V, H))
M = int(sys.argv[1]) if len(sys.argv) > 1 else 1
ws = [torch.randn(n, k, dtype=torch.bfloat16) * 0.02 for n, k in shapes]
torch_packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws]
handlers = [ops.create_onednn_mm(w.t(), 32) for w in ws]
xs = {k: torch.randn(M, k, dtype=torch.bfloat16) for k in (H, I)}
def run_torch():
    for (_n, k), p in zip(shapes, torch_packed, strict=False):
        torch.ops.mkldnn._linear_pointwise(xs[k], p, None, "none", [], "")
def run_vllm():
    for (_n, k), h in zip(shapes, handlers, strict=False):
        ops.onednn_mm(h, xs[k], None)
gb = sum(w.numel() * 2 for w in ws) / 1e9
for f in (run_torch, run_vllm):
    f()
    f()
res = {"torch": [], "vllm": []}
for i in range(12):
    order = [("torch", run_torch), ("vllm", run_vllm)] if i % 2 == 0 else [("vllm", run_vllm), ("torch", run_torch)]
    for name, f in order:
        t = time.perf_counter()
        f()
        res[name].append(time.perf_counter() - t)
for name, ts in res.items():
    ts = sorted(ts)
    print(name, "M", M, "median ms %.1f" % (1000 * ts[6]), "GB/s %.1f" % (gb / ts[6]))
ratios = sorted(a / b for a, b in zip(res["torch"], res["vllm"], strict=False))
print("torch/vllm time ratio median", ratios[6])
