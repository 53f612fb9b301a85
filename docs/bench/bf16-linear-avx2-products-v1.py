"""bf16 products on a CPU whose torch and oneDNN run at AVX2, by row count: tandem's kernel (core.bf16_linear, its
AVX2 path) on bf16 weights, against oneDNN's prepacked float32 product (what `--dtype auto` picked on an AVX2 CPU
before the kernel had an AVX2 path) and PyTorch's bf16 `F.linear` (what a bf16 model ran there: oneDNN packs no
bf16 at AVX2). 28 distinct [8960 x 1536] weights (the 1.5B target's MLP shape; 770 MB in bf16, 1.5 GB in float32)
streamed from memory in turn, the best of 4 passes per product and row count, the arms' order reversed at every
other row count. On an AVX-512 CPU, torch's and oneDNN's own settings hold them to AVX2 (as the command below does):

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 PYTHONPATH=services \\
        python docs/bench/bf16-linear-avx2-products-v1.py out.json [ROWS ...]     # about 3 min
"""

from __future__ import annotations

import json
import platform
import runpy
import sys
from pathlib import Path

import torch

from tandem.core import bf16_linear

# The products' shape, count and timing loop: the AVX-512 comparison's (its per_layer, best of its PASSES).
SHARED = runpy.run_path(str(Path(__file__).with_name("bf16-linear-products-v1.py")))
OUT, IN, LAYERS, PASSES, per_layer = (SHARED[name] for name in ("OUT", "IN", "LAYERS", "PASSES", "per_layer"))
ROWS = (1, 2, 3, 5, 8, 12, 16, 24, 64, 256)


def main(path: str, rows_timed: tuple[int, ...] = ROWS) -> None:
    torch.set_num_threads(2)
    assert bf16_linear.ready(), "the kernel does not run here"
    plain = [torch.randn(OUT, IN).bfloat16() * 0.05 for _ in range(LAYERS)]
    arms = {
        "kernel_bf16": (lambda x, w: bf16_linear.bf16_linear(x, w, None), [bf16_linear.pack(w) for w in plain],
                        torch.bfloat16),
        "onednn_f32": (lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
                       [torch.ops.mkldnn._reorder_linear_weight(w.float(), None) for w in plain], torch.float32),
        "torch_bf16": (torch.nn.functional.linear, plain, torch.bfloat16),
    }
    report = {"config": {"shape": [OUT, IN], "layers": LAYERS, "passes": PASSES, "threads": 2,
                         "capability": torch.backends.cpu.get_cpu_capability(), "kernel_isa": bf16_linear.isa_bits(),
                         "torch": torch.__version__, "machine": platform.processor() or platform.machine()},
              "rows": {}}
    for index, rows in enumerate(rows_timed):
        names = list(arms) if index % 2 == 0 else list(arms)[::-1]
        ms = {name: per_layer(arms[name][0], arms[name][1], rows, arms[name][2]) * 1e3 for name in names}
        report["rows"][str(rows)] = {**{f"{name}_ms": round(ms[name], 4) for name in arms},
                                     "kernel_over_f32": round(ms["onednn_f32"] / ms["kernel_bf16"], 3),
                                     "kernel_over_torch_bf16": round(ms["torch_bf16"] / ms["kernel_bf16"], 3)}
        print(rows, report["rows"][str(rows)], file=sys.stderr, flush=True)
    with open(path, "w") as out:
        json.dump(report, out, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], tuple(int(rows) for rows in sys.argv[2:]) or ROWS)
