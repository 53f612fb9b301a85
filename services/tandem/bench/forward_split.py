"""How much of a decode forward is its matrix products: the forward against the same products run alone.

A decode step streams every weight once, so its floor is the time its products take. For each model of the pair and
each row count, one sequence per row is cached (`--context` tokens, more for later rows so their lengths differ), and
three things alternate, in rotating order, for `--steps` rounds:
- `eager`: the runner's eager decode forward, one new token per row (rolled back after, so every round sees the
  same context);
- `compiled` (with `--compile`): the same forward by a runner whose static decode forwards torch.compile compiled;
- `products`: every product layer of the model (packed, fused, int8 or a plain nn.Linear) called once
  on random activations of the forward's rows, the output head on one row per sequence, as the forward calls them.
Reported per model and row count: each one's median seconds, and the median of each round's forward / products
ratio, whose excess over 1 is what runs between the products (norms, rotary, attention, residuals, Python, guards).

    python -m tandem.bench.forward_split --rows 1 8 --json split.json
    python -m tandem.bench.forward_split --rows 1 8 --compile --json split.json     # plus a compiled runner
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from tandem.bench.packing import packable_dtype
from tandem.cli.common import add_bench_model_options
from tandem.cli.options import DefaultsHelpFormatter, add_json_option, write_json
from tandem.core.model_options import QUANTIZATIONS
from tandem.core.packed_linear import weight_bytes
from tandem.core.runner import ModelRunner
from tandem.models.loader import load_model


def product_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers whose products a forward streams, in module order (the output head among them): those
    core.packed_linear.weight_bytes counts."""
    return [module for module in model.modules()
            if hasattr(module, "weight_bytes") or isinstance(module, torch.nn.Linear)]


def _products(layers: list[torch.nn.Module], head: torch.nn.Module, rows: int, dtype: torch.dtype):
    inputs = {layer: torch.randn(1 if layer is head else rows, layer.in_features, dtype=dtype) for layer in layers}

    def run() -> None:
        for layer in layers:
            layer(inputs[layer])
    return run


def cached_state(runner: ModelRunner, tag: str, context: int, offset: int = 0):
    """A sequence of `context` made-up tokens (`offset` varies them), prefilled: what a benchmarked forward decodes
    after."""
    state = runner.state(tag)
    state.sync(0, [(offset + 7 + 13 * i) % runner.vocab_size for i in range(context)])
    runner.prefill(state, len(state.tokens))
    return state


def _forward(runner: ModelRunner, states: list) -> None:
    keeps = [len(state.tokens) for state in states]
    for state, keep in zip(states, keeps, strict=True):
        state.sync(keep, [(11 * keep) % runner.vocab_size])
    runner.forward_on_device(states, [1] * len(states))
    for state, keep in zip(states, keeps, strict=True):
        state.sync(keep, [])  # rolled back: the next round sees the same context


def split_model(name: str, dtype: torch.dtype, rows_list: list[int], steps: int, context: int, compile: bool,
                quantization: str) -> dict:
    model = load_model(name, device=torch.device("cpu"), dtype=dtype, progress=False, quantization=quantization).model
    runners = {"eager": ModelRunner(model, compile=False)}
    if compile:
        runners["compiled"] = ModelRunner(model, compile=True)
    layers = product_layers(model)
    head = model.get_output_embeddings()
    report: dict = {"product_layers": len(layers), "weight_bytes": weight_bytes(model)}
    for rows in rows_list:
        jobs = {}
        tags = [f"split-{rows}-{row}" for row in range(rows)]
        for variant, runner in runners.items():
            states = [cached_state(runner, tag, context + 37 * row, offset=row) for row, tag in enumerate(tags)]
            jobs[variant] = (lambda r=runner, s=states: _forward(r, s))
        jobs["products"] = _products(layers, head, rows, dtype)
        with torch.inference_mode():
            firsts = {}
            for variant, job in jobs.items():  # untimed in the rounds: it may compile
                started = time.perf_counter()
                job()
                firsts[variant] = time.perf_counter() - started
            times: dict[str, list[float]] = {variant: [] for variant in jobs}
            order = list(jobs)
            for step in range(steps):
                for variant in order[step % len(order):] + order[: step % len(order)]:
                    started = time.perf_counter()
                    jobs[variant]()
                    times[variant].append(time.perf_counter() - started)
        result = {f"{variant}_s": round(statistics.median(t), 5) for variant, t in times.items()}
        result |= {f"{variant}_over_products": round(statistics.median(
            a / b for a, b in zip(times[variant], times["products"], strict=True)), 4) for variant in runners}
        result["first_s"] = {variant: round(seconds, 3) for variant, seconds in firsts.items()}
        if compile:
            result["compiled"] = bool(runners["compiled"].graphs is not None and runners["compiled"].graphs.compiled)
        report[str(rows)] = result
        # Free the slots: a forward runs over every slot up to its last row, so rows left from this count would
        # widen the next count's forwards.
        for runner in runners.values():
            for tag in tags:
                runner.release(tag)
        print(f"{name} rows {rows}: " + ", ".join(f"{v} {result[f'{v}_s'] * 1e3:.1f} ms" for v in jobs) + "; "
              + ", ".join(f"{v}/products {result[f'{v}_over_products']:.3f}" for v in runners), flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    add_bench_model_options(parser, "bfloat16", "both models' dtype (one oneDNN packs here)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="sequences in a forward")
    parser.add_argument("--steps", type=int, default=30, help="rounds of the alternated forwards per row count")
    parser.add_argument("--context", type=int, default=200, help="tokens cached for the first row")
    parser.add_argument("--compile", action="store_true", help="also a runner with compiled decode forwards")
    parser.add_argument("--draft-quantization", choices=QUANTIZATIONS, default="none", help="the draft's weights")
    parser.add_argument("--models", nargs="+", choices=("target", "draft"), default=["target", "draft"])
    add_json_option(parser, "the report")
    args = parser.parse_args(argv)
    if min(args.rows) < 1 or args.steps < 1 or args.context < 1:
        parser.error("--rows, --steps and --context must be at least 1")
    dtype = packable_dtype(parser, args)
    report: dict = {"config": {"target": args.target, "draft": args.draft, "dtype": args.dtype,
                               "threads": args.threads, "rows": args.rows, "steps": args.steps,
                               "context": args.context, "compile": args.compile,
                               "draft_quantization": args.draft_quantization, "torch": torch.__version__,
                               "machine": platform.processor() or platform.machine()}}
    for role in args.models:
        report[role] = split_model(getattr(args, role), dtype, args.rows, args.steps, args.context, args.compile,
                                   args.draft_quantization if role == "draft" else "none")
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
