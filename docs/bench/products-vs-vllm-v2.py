"""tandem's packed products against vLLM's, in one process of vLLM's venv: oneDNN's linear on a weight reordered once
(torch.ops.mkldnn._linear_pointwise, which tandem's compiled forwards call: core.packed_linear, lowered by
lower_to_onednn) and vLLM's own oneDNN matmul handler (vllm._custom_ops.onednn_mm, what vLLM for CPU 0.32 runs for a
bf16 linear layer on this CPU). The 1.5B target's products (fused qkv, o, fused gate_up, down) over 28 layers and its
output head, random bf16 weights of the real shapes, each weight distinct so that they stream from memory. Per row
count: the median over ROUNDS of a whole forward's products, the arms alternated round by round, and the largest
difference between the two results (oneDNN's same kernel: 0 expected).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:/work/vllm-venv/lib/libiomp5.so \
    PYTHONPATH=services /work/vllm-venv/bin/python docs/bench/products-vs-vllm-v2.py ROUNDS OUT.json   # 2 min
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
from vllm import _custom_ops as ops

from tandem.core.packed_linear import PackedLinear

SHAPES = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)]  # out, in features of each layer's products
LAYERS, HEAD = 28, (151936, 1536)


def main(rounds: int, out: str) -> None:
    torch.set_num_threads(2)
    weights = [torch.randn(o, i).bfloat16() * 0.02 for _ in range(LAYERS) for o, i in SHAPES]
    weights.append(torch.randn(*HEAD).bfloat16() * 0.02)
    tandem = [PackedLinear(w, None) for w in weights]
    vllm = [ops.create_onednn_mm(w.t(), 32) for w in weights]
    del weights
    linear = torch.ops.mkldnn._linear_pointwise.default
    arms = {"tandem": lambda x, i: linear(x, tandem[i].packed, None, "none", [], ""),
            "vllm": lambda x, i: ops.onednn_mm(vllm[i], x, None)}
    report: dict = {"rounds": rounds, "threads": 2, "torch": torch.__version__, "rows": {}}
    with torch.inference_mode():
        for rows in (1, 2, 8, 16):
            inputs = {k: torch.randn(rows, k).bfloat16() for k in (1536, 8960)}
            xs = [inputs[layer.in_features] for layer in tandem]
            diff = max((arms["tandem"](xs[i], i).float() - arms["vllm"](xs[i], i).float()).abs().max().item()
                       for i in (0, 1, 2, 3, len(tandem) - 1))
            times: dict[str, list[float]] = {arm: [] for arm in arms}
            for round_ in range(rounds + 1):
                for arm in list(arms)[:: 1 if round_ % 2 else -1]:
                    started = time.perf_counter()
                    for i, x in enumerate(xs):
                        arms[arm](x, i)
                    if round_:  # the first round warms up
                        times[arm].append(time.perf_counter() - started)
            ms = {arm: statistics.median(t) * 1e3 for arm, t in times.items()}
            report["rows"][rows] = {"ms": {arm: round(m, 2) for arm, m in ms.items()},
                                    "tandem_over_vllm": round(ms["tandem"] / ms["vllm"], 3), "max_difference": diff}
            print(rows, json.dumps(report["rows"][rows]), flush=True)
    with open(out, "w") as sink:
        json.dump(report, sink, indent=1)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
