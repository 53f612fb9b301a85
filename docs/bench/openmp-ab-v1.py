"""tandem under the OpenMP runtime torch ships (libgomp) against Intel's (libiomp5, preloaded, as vLLM for CPU runs
torch), with and without tcmalloc. A runtime is a process setting, so each arm is a fresh process: CYCLES cycles,
the arms' order reversed every other cycle. What a process times (--kind):

  products  the 1.5B target's products (fused qkv, o, fused gate_up, down) over --layers layers and its output head,
            random bf16 weights of the real shapes, each distinct so that they stream from memory, through
            torch.ops.mkldnn._linear_pointwise on weights packed once (core.packed_linear, what the compiled forwards
            call); 8 layers are 0.75 GB of weights, far past the caches
  forward   the target's compiled decode forward (bf16, the real weights, compiled from the kept cache), each row
            with 300 cached tokens, as docs/bench/forward-profile-v1.py times it

at 1 and 8 rows, the median over --rounds. Reported per arm and row count: each process's median, their median, its
ratio to libgomp's (over_gomp), and `paired`, the median over cycles of each cycle's ratio to that cycle's libgomp
process (the machine's speed drifts by up to 1.3x within minutes; a cycle's processes run back to back).

    PYTHONPATH=services .venv/bin/python docs/bench/openmp-ab-v1.py --kind products --cycles 20 --rounds 9 \
        --layers 8 --json docs/bench/openmp-products-v2.json                                     # 8 min
    PYTHONPATH=services .venv/bin/python docs/bench/openmp-ab-v1.py --kind forward --cycles 8 --rounds 10 \
        --json forward.json                               # about 7 min a cycle (compiling from the cache)

--iomp defaults to /work/vllm-venv/lib/libiomp5.so (vLLM's venv: intel-openmp
2024.2.1, the version tandem's `cpu` extra pins).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tandem.core.cpu_runtime import suggested_preload

SHAPES = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)]  # out, in features of each layer's products
HEAD = (151936, 1536)
ROWS = (1, 8)


def timed(call, rounds: int, warmup: int = 1) -> float:
    """The median of `rounds` calls' wall time in ms, after `warmup` untimed ones."""
    times = []
    for round_ in range(warmup + rounds):
        started = time.perf_counter()
        call()
        if round_ >= warmup:
            times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def products(rounds: int, layers: int) -> dict[str, float]:
    import torch

    from tandem.core.packed_linear import PackedLinear

    shapes = [shape for _ in range(layers) for shape in SHAPES] + [HEAD]
    packed = [PackedLinear(torch.empty(o, i, dtype=torch.bfloat16).normal_(std=0.02), None) for o, i in shapes]
    linear = torch.ops.mkldnn._linear_pointwise.default
    result = {}
    for rows in ROWS:
        inputs = {k: torch.randn(rows, k).bfloat16() for k in (1536, 8960)}
        xs = [inputs[layer.in_features] for layer in packed]

        def forward(xs: list = xs) -> None:
            for layer, x in zip(packed, xs, strict=True):
                linear(x, layer.packed, None, "none", [], "")

        result[str(rows)] = timed(forward, rounds)
    return result


def forward(rounds: int) -> dict[str, float]:
    import torch

    from tandem.bench.forward_split import _forward, cached_state
    from tandem.core.runner import ModelRunner
    from tandem.models.loader import load_model

    model = load_model("qwen2.5-coder-1.5b-instruct", device=torch.device("cpu"), dtype=torch.bfloat16,
                       progress=False).model
    runner = ModelRunner(model, compile=True)
    result = {}
    for rows in ROWS:
        tags = [f"r{rows}p{row}" for row in range(rows)]
        states = [cached_state(runner, tag, 300, offset=row) for row, tag in enumerate(tags)]
        result[str(rows)] = timed(lambda states=states: _forward(runner, states), rounds, warmup=3)
        for tag in tags:
            runner.release(tag)
    return result


def child(kind: str, rounds: int, layers: int) -> None:
    import torch

    torch.set_num_threads(2)
    with torch.inference_mode():
        result = products(rounds, layers) if kind == "products" else forward(rounds)
    print(json.dumps({"openmp": runtime(), **result}), flush=True)


def runtime() -> str:
    with open("/proc/self/maps") as maps:
        text = maps.read()
    return "libiomp5" if "libiomp5" in text else "libgomp" if "libgomp" in text else "unknown"


def main(args: argparse.Namespace) -> None:
    if not Path(args.iomp).is_file():
        sys.exit(f"no {args.iomp}: give --iomp (intel-openmp's libiomp5.so)")
    arms = {"gomp": [], "iomp": [args.iomp], "iomp_tcmalloc": [suggested_preload(Path(args.iomp))]}
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    command = [sys.executable, __file__, "--child", "--kind", args.kind, "--rounds", str(args.rounds),
               "--layers", str(args.layers)]
    for cycle in range(args.cycles):
        for arm in list(arms)[:: -1 if cycle % 2 else 1]:
            env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
            if arms[arm]:
                env["LD_PRELOAD"] = ":".join(arms[arm])
            done = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
            runs[arm].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(cycle, arm, runs[arm][-1], flush=True)
    rows = [str(r) for r in ROWS]
    medians = {arm: {r: statistics.median(run[r] for run in rs) for r in rows} for arm, rs in runs.items()}
    paired = {arm: {r: statistics.median(a[r] / g[r] for a, g in zip(rs, runs["gomp"], strict=True)) for r in rows}
              for arm, rs in runs.items()}
    faster = {arm: {r: sum(a[r] < g[r] for a, g in zip(rs, runs["gomp"], strict=True)) for r in rows}
              for arm, rs in runs.items() if arm != "gomp"}
    report = {"kind": args.kind, "cycles": args.cycles, "rounds": args.rounds, "layers": args.layers, "threads": 2,
              "iomp": args.iomp, "runs": runs,
              "median_ms": {arm: {r: round(ms, 2) for r, ms in m.items()} for arm, m in medians.items()},
              "over_gomp": {arm: {r: round(m[r] / medians["gomp"][r], 3) for r in rows} for arm, m in medians.items()},
              "paired": {arm: {r: round(x, 3) for r, x in p.items()} for arm, p in paired.items()},
              "cycles_faster_than_gomp": faster}
    print(json.dumps({k: report[k] for k in ("over_gomp", "paired", "cycles_faster_than_gomp")}), flush=True)
    with open(args.json, "w") as sink:
        json.dump(report, sink, indent=1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kind", choices=("products", "forward"), default="products")
    parser.add_argument("--cycles", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--json", default="openmp-ab.json")
    parser.add_argument("--iomp", default="/work/vllm-venv/lib/libiomp5.so")
    options = parser.parse_args()
    if options.child:
        child(options.kind, options.rounds, options.layers)
    else:
        main(options)
