"""One-row products on a GPU: core.triton_gemv's kernel at several tile sizes against cuBLAS, per product of the real
pair's decoder layers (q/k/v with its bias, o, gate/up, down), batch 1, bf16; one JSON out.

Each side runs LAYERS calls over LAYERS distinct random weights (so no weight is read from the L2 cache, as in a
forward), recorded in one CUDA graph and replayed (so launches cost what they cost inside the runner's graphs);
reported per call: µs and the weight bytes read per second. cuBLAS runs the product alone. The kernel runs it folded
as core.folded_layers folds it (q/k/v with its RMSNorm and the rotary embedding of q and k, gate/up with its
RMSNorm, o with the residual add, down with the activation and the residual add: work that cuBLAS's side leaves
out, which an unfolded forward runs in kernels of its own) at each tile size, and alone at the best one, like for
like with cuBLAS. The best tiles per shape are what
core.triton_gemv.TUNED takes; a shape whose folded kernel loses to cuBLAS plus its own norm or activation goes in
core.fused_linear.CUBLAS_SHAPES.

    python -m tandem.bench.row_products --json gpu-row-products.json   # 1-2 minutes on an H200, mostly compiles
    python -m tandem.bench.row_products --summarize gpu-row-products.json  # its table, for docs/performance.md
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from tandem.bench.gpu_runs import CONFIGS, HBM_BYTES_PER_S
from tandem.core.fused_linear import StackedLinear

LAYERS = 28
# (BLOCK_N, BLOCK_K, warps) tried for every shape; launch_settings' own pick is timed as "default"
TILES = [(2, 1024, 4), (4, 512, 4), (8, 256, 4), (8, 512, 4), (16, 256, 4), (16, 512, 8)]


def products(role: str) -> dict[str, tuple[int, int, bool, bool, bool, bool, int, int]]:
    """name: (N, K, bias, norm, gated, residual, rotated columns, head dim) of one decoder layer's products, stacked
    and folded as the GPU loader stacks and folds them (core.folded_layers: q/k/v rotates q and k)."""
    config = CONFIGS[role]
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head
    return {"qkv": (hidden + 2 * kv, hidden, True, True, False, False, hidden + kv, head),
            "o": (hidden, hidden, False, False, False, True, 0, 0),
            "gate_up": (2 * inter, hidden, False, True, False, False, 0, 0),
            "down": (hidden, inter, False, False, True, True, 0, 0)}


def graph_us(calls, reps: int) -> float:
    """µs per call of `calls` (a list of closures), recorded once in a CUDA graph and replayed `reps` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # compiles and warms outside the capture
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps / len(calls)


def measure(n: int, k: int, bias: bool, norm: bool, gated: bool, residual: bool, rope: int, head: int, reps: int,
            device: torch.device) -> dict:
    """One product's figures: cuBLAS alone, the folded kernel at each tile (its best one the product's pick), and
    the kernel alone at that tile (the like-for-like comparison with cuBLAS)."""
    from tandem.core import triton_gemv

    def tensor(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=torch.bfloat16)

    weights = [tensor(n, k) / k**0.5 for _ in range(LAYERS)]
    x, b = tensor(1, 1, k), tensor(n) if bias else None
    # folded: the row is the norm's input, or gate/up's output [2K]; the residual is the layer's input
    row, res, gain = tensor(1, 1, 2 * k if gated else k), tensor(1, 1, n) if residual else None, tensor(k).abs() + 0.5
    angles = torch.rand(1, 1, head, device=device) * 6  # a position's rotary angles, for q/k/v's rotation
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    fold = {"bias": b, "norm": gain if norm else None, "eps": 1e-6, "residual": res, "gated": gated,
            "rope": (cos, sin, rope, head) if rope else None}
    product = StackedLinear(weights[0], b)  # the folded product in torch ops: the reference
    if norm:
        product.norm, product.eps = torch.nn.Parameter(gain, requires_grad=False), 1e-6
    product.rope_columns, product.head_dim = rope, head
    reference = product.in_torch(row, res, gated, (cos, sin) if rope else None).float()
    nbytes = n * k * 2
    # Errors in bf16 steps at the largest output (bf16 keeps 8 significant bits: values in [2**e, 2**(e+1)) lie
    # 2**(e-7) apart): the reference rounds to bf16 after each op, the kernel once, so a few steps part them.
    step = 2.0 ** (math.floor(math.log2(float(reference.abs().max()))) - 7)
    out: dict = {"n": n, "k": k, "bias": bias, "norm": norm, "gated": gated, "residual": residual,
                 "rotated_columns": rope, "weight_bytes": nbytes, "bf16_step": step}

    def rate(calls) -> dict:
        us = graph_us(calls, reps)
        return {"us": us, "tb_s": nbytes / us / 1e6}

    out["cublas"] = rate([lambda w=w: torch.nn.functional.linear(x, w, b) for w in weights])
    tiles: dict[str, dict] = {}
    for tile in [None, *TILES]:
        name = "default" if tile is None else "x".join(map(str, tile))
        if tile is not None:
            triton_gemv.TUNED[(n, k)] = tile
        try:
            error = float((triton_gemv.row_product(row, weights[0], **fold).float() - reference).abs().max())
            tiles[name] = rate([lambda w=w: triton_gemv.row_product(row, w, **fold) for w in weights])
            tiles[name] |= {"max_abs_error": error, "error_bf16_steps": error / step}
        except Exception as exc:  # a tile that does not build or launch is reported, the others still run
            tiles[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        finally:
            triton_gemv.TUNED.pop((n, k), None)
    out["kernel_folded"] = tiles
    timed = {name: t["us"] for name, t in tiles.items() if "us" in t}
    if not timed:
        out["best"] = None
        return out
    best = min(timed, key=timed.get)
    if best != "default":
        triton_gemv.TUNED[(n, k)] = tuple(int(v) for v in best.split("x"))
    out["kernel_alone"] = rate([lambda w=w: triton_gemv.row_product(x, w, b) for w in weights])
    triton_gemv.TUNED.pop((n, k), None)
    out["best"] = {"tile": best, "folded_us": timed[best],
                   "alone_over_cublas": out["cublas"]["us"] / out["kernel_alone"]["us"]}
    return out


def best_tiles(path: str | Path) -> dict[tuple[int, int], tuple[int, int, int]]:
    """A report's best tile per weight shape, (N, K): (BLOCK_N, BLOCK_K, warps), as core.triton_gemv.TUNED takes
    them; shapes whose best was launch_settings' own pick, or where no tile ran, are left out."""
    tiles = {}
    for result in json.loads(Path(path).read_text())["results"].values():
        best = result.get("best")
        if best and best["tile"] != "default":
            tiles[result["n"], result["k"]] = tuple(int(v) for v in best["tile"].split("x"))
    return tiles


def summary(path: str | Path) -> str:
    """A report as a markdown table, a row per product: cuBLAS against the kernel alone (like for like) and folded,
    µs a call and TB/s, at the best tile; for docs/performance.md."""
    rows = ["| product (N x K) | cuBLAS | the kernel alone | folded | best tile |",
            "| --- | ---: | ---: | ---: | --- |"]
    for name, result in json.loads(Path(path).read_text())["results"].items():
        best, product = result.get("best"), f"{name} ({result['n']} x {result['k']})"
        if best is None:
            rows.append(f"| {product} | {result['cublas']['us']:.2f} µs | no tile ran | | |")
            continue
        cells = [result["cublas"], result["kernel_alone"], result["kernel_folded"][best["tile"]]]
        rows.append(f"| {product} | " + " | ".join(f"{c['us']:.2f} µs, {c['tb_s']:.2f} TB/s" for c in cells)
                    + f" | {best['tile']} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="gpu-row-products.json")
    parser.add_argument("--reps", type=int, default=20, help="graph replays per side")
    parser.add_argument("--roles", default="target,draft")
    parser.add_argument("--summarize", metavar="REPORT", help="print a report as a markdown table and stop (no GPU)")
    args = parser.parse_args(argv)
    if args.summarize:
        print(summary(args.summarize))
        return
    if not torch.cuda.is_available():
        sys.exit("tandem.bench.row_products needs a CUDA GPU (the kernels are timed in CUDA graphs)")
    started = time.perf_counter()
    device = torch.device("cuda")
    name = torch.cuda.get_device_name()
    report: dict = {"device": name, "torch": torch.__version__, "layers": LAYERS,
                    "command": "python -m tandem.bench.row_products " + " ".join(sys.argv[1:]), "results": {}}
    hbm = next((v for key, v in HBM_BYTES_PER_S.items() if key in name), None)
    for role in args.roles.split(","):
        for product, shape in products(role).items():
            result = measure(*shape, args.reps, device)
            if hbm:
                result["cublas"]["share_of_peak"] = result["cublas"]["tb_s"] * 1e12 / hbm
            report["results"][f"{role}_{product}"] = result
            report["wall_seconds"] = time.perf_counter() - started
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
            if result["best"] is None:
                print(f"{role} {product}: no tile ran: {result['kernel_folded']}", flush=True)
                continue
            best = result["best"]
            print(f"[{report['wall_seconds']:6.1f}s] {role} {product}: cuBLAS {result['cublas']['us']:.2f} us, "
                  f"the kernel alone {result['kernel_alone']['us']:.2f} us ({best['alone_over_cublas']:.2f}x), "
                  f"folded {best['folded_us']:.2f} us at {best['tile']}", flush=True)
    print(f"wrote {args.json}", flush=True)


if __name__ == "__main__":
    main()
