"""bf16 products alone, tandem's kernel (core.bf16_linear) against oneDNN's prepacked one, by row count: 28 distinct
[8960 x 1536] weights (the 1.5B target's MLP shape, 770 MB, more than the L3 holds) streamed from memory in turn,
the best of 4 passes per kernel and row count. The kernel's multiply-add path is `kernel`; where the CPU runs its
AVX512-BF16 dot-product path too, that one is `dot` beside it.

    PYTHONPATH=services python docs/bench/bf16-linear-products-v1.py out.json [ROWS ...]   # about 1 min

ROWS: the row counts to time (default 1-64); prompt-sized ones (128-512) time the prefill's products.
"""

from __future__ import annotations

import json
import platform
import sys
import time

import torch

from tandem.core import bf16_linear

OUT, IN, LAYERS, PASSES = 8960, 1536, 28, 4
ROWS = (1, 2, 3, 4, 5, 8, 12, 16, 24, 32, 64)


def per_layer(product, weights: list[torch.Tensor], rows: int, dtype: torch.dtype = torch.bfloat16) -> float:
    """The best of PASSES passes over `weights` of `product` on `rows` random rows, seconds per weight."""
    x = torch.randn(rows, IN).to(dtype)
    for weight in weights:  # a first pass untimed
        product(x, weight)
    best = float("inf")
    for _ in range(PASSES):
        started = time.perf_counter()
        for weight in weights:
            product(x, weight)
        best = min(best, (time.perf_counter() - started) / len(weights))
    return best


def main(path: str, rows_timed: tuple[int, ...] = ROWS) -> None:
    torch.set_num_threads(2)
    assert bf16_linear.ready(), "the kernel does not run here"
    plain = [torch.randn(OUT, IN, dtype=torch.bfloat16) * 0.05 for _ in range(LAYERS)]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(weight, None) for weight in plain]
    ours = [bf16_linear.pack(weight) for weight in plain]
    del plain

    def by_onednn(x, packed):
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    def on_path(bits: int):
        def by_kernel(x, packed):
            with bf16_linear.isa(bits):
                return bf16_linear.bf16_linear(x, packed, None)
        return by_kernel

    kernels = [("kernel", on_path(512), ours)] + ([("dot", on_path(bf16_linear.DOT), ours)]
                                                 if bf16_linear.runs_dot() else [])

    report = {"config": {"shape": [OUT, IN], "layers": LAYERS, "passes": PASSES, "threads": 2,
                         "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
                         "probe": bf16_linear.probed()},
              "rows": {}}
    for rows in rows_timed:
        # Alternated: oneDNN first at odd row counts, the kernel's paths first at even ones.
        order = [("onednn", by_onednn, onednn), *kernels]
        times = {name: per_layer(product, weights, rows) for name, product, weights in
                 (order if rows % 2 else order[::-1])}
        report["rows"][str(rows)] = {"onednn_ms": round(times["onednn"] * 1e3, 4),
                                     "kernel_ms": round(times["kernel"] * 1e3, 4),
                                     "speedup": round(times["onednn"] / times["kernel"], 3),
                                     "kernel_weight_gb_s": round(OUT * IN * 2 / times["kernel"] / 1e9, 2),
                                     "onednn_weight_gb_s": round(OUT * IN * 2 / times["onednn"] / 1e9, 2)}
        if "dot" in times:
            report["rows"][str(rows)].update({"dot_ms": round(times["dot"] * 1e3, 4),
                                              "dot_speedup": round(times["onednn"] / times["dot"], 3),
                                              "dot_over_kernel": round(times["kernel"] / times["dot"], 3)})
        print(rows, report["rows"][str(rows)], file=sys.stderr, flush=True)
    with open(path, "w") as out:
        json.dump(report, out, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], tuple(int(rows) for rows in sys.argv[2:]) or ROWS)
