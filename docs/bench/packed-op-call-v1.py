"""One packed product of a 256 x 1536 bf16 weight at one row, called four ways, alternated: oneDNN's op directly,
through core.packed_linear._product, through the custom op object, and through torch.ops (the path a compiled graph
takes). Prints microseconds per call (medians of 30 rounds of 200 calls).

    PYTHONPATH=services python docs/bench/packed-op-call-v1.py
"""
import statistics
import time

import torch

from tandem.core.packed_linear import PackedLinear, _product, onednn_linear

torch.set_num_threads(2)
w = torch.randn(256, 1536, dtype=torch.bfloat16)
lin = PackedLinear(w, None)
x = torch.randn(1, 1, 1536, dtype=torch.bfloat16)
def direct(): return torch.ops.mkldnn._linear_pointwise(x, lin.packed, None, "none", [], "")
def viaprod(): return _product(x, lin.packed, None, 256)
def custom(): return onednn_linear(x, lin.packed, None, 256)
def opsdef(): return torch.ops.tandem.onednn_linear(x, lin.packed, None, 256)
fns = {"direct": direct, "_product": viaprod, "custom_op": custom, "torch.ops": opsdef}
with torch.inference_mode():
    for f in fns.values():
        for _ in range(200):
            f()
    t = {k: [] for k in fns}
    for _rep in range(30):
        for k, f in fns.items():
            s = time.perf_counter()
            for _ in range(200):
                f()
            t[k].append((time.perf_counter() - s) / 200 * 1e6)
print({k: round(statistics.median(v), 2) for k, v in t.items()}, "us per call")
