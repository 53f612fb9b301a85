"""The 0.5B draft's 96 layer products (24 layers of q/k/v, o, gate/up and down, each layer's weights its own, so
they stream from memory as a forward's do; random weights of the real shapes, bf16 activations) through three
kernels: oneDNN's prepacked bf16 product, core.w8a8_linear's layer (eager: its rows quantized around oneDNN's int8
GEMM) and PyTorch's weight-only int4 CPU kernel at core.w4_linear's group size. Rounds alternate the kernels' order;
the median of rounds 3 on, per row count.

    PYTHONPATH=services python docs/bench/int4-kernels-v1.py out.json      # 2 min
"""
import json
import statistics
import sys
import time

import torch

from tandem.core.w4_linear import W4Linear

torch.set_num_threads(2)
torch.manual_seed(0)
SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]  # [out, in]: fused q/k/v, o, fused gate/up, down
LAYERS, ROUNDS = 24, 12
products: dict[str, list] = {"bf16": [], "w8a8": [], "int4": []}
with torch.inference_mode():
    for _ in range(LAYERS):
        for out_features, in_features in SHAPES:
            weight = (torch.randn(out_features, in_features) * 0.02).to(torch.bfloat16)
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            products["bf16"].append((in_features, lambda x, p=packed: torch.ops.mkldnn._linear_pointwise(
                x, p, None, "none", [], "")))
            w4 = W4Linear(weight, None, torch.bfloat16)
            products["w8a8"].append((in_features, w4.wide))
            products["int4"].append((in_features, w4._int4))
    report = {"layers": LAYERS, "shapes": SHAPES, "rounds": ROUNDS, "group": products["int4"][0][1].__self__.group,
              "threads": 2, "ms": {}}
    for rows in (1, 2, 8):
        inputs = {width: torch.randn(rows, width, dtype=torch.bfloat16) for width in (896, 4864)}
        times: dict[str, list[float]] = {kind: [] for kind in products}
        for round_ in range(ROUNDS):
            for kind in list(products)[:: 1 if round_ % 2 == 0 else -1]:
                started = time.perf_counter()
                for width, product in products[kind]:
                    product(inputs[width])
                times[kind].append(time.perf_counter() - started)
        report["ms"][str(rows)] = {kind: round(statistics.median(t[2:]) * 1e3, 2) for kind, t in times.items()}
        print(rows, report["ms"][str(rows)], flush=True)
with open(sys.argv[1], "w") as sink:
    json.dump(report, sink, indent=1)
