"""Fused sibling linears (core.fused_linear) against the same prepacked layers unfused, forward by forward, one sitting.

Each model of the pair is loaded twice in one dtype, prepacked with and without fusing q/k/v and gate/up, and the two
copies' runners hold one sequence of the same context each. Then forwards of each width alternate between the copies
(A B, then B A) for `--steps` pairs; each forward feeds `width` tokens at the context's end and is rolled back, so
every forward sees the same context. Reported per model and width: the median seconds of each copy, unfused over fused
(the median of each back-to-back pair's ratio; above 1: fusion is faster), and the largest difference between their
logits (the wider products round otherwise).

    python -m tandem.bench.fusion --json fusion.json      # about 2 min on a 2-core CPU
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from tandem.cli.common import add_bench_model_options
from tandem.cli.options import DefaultsHelpFormatter, add_json_option, write_json
from tandem.core.packed_linear import prepack, supported
from tandem.core.runner import ModelRunner
from tandem.models.loader import load_model

COPIES = ("fused", "unfused")


def _ids(count: int, vocab: int, offset: int = 0) -> list[int]:
    return [(offset + 7 + 13 * i) % vocab for i in range(count)]


def _runner(name: str, dtype: torch.dtype, fuse_siblings: bool, context: int):
    loaded = load_model(name, device=torch.device("cpu"), dtype=dtype, progress=False, eager=True)
    prepack(loaded.model, fuse_siblings=fuse_siblings)
    runner = ModelRunner(loaded.model)
    state = runner.state("bench")
    state.sync(0, _ids(context, runner.vocab_size))
    runner.prefill(state, context)
    return runner, state


def _forward(runner: ModelRunner, state, width: int) -> tuple[float, torch.Tensor]:
    keep = len(state.tokens)
    state.sync(keep, _ids(width, runner.vocab_size, offset=keep))
    started = time.perf_counter()
    logits = runner.forward_on_device([state], [width])
    seconds = time.perf_counter() - started
    state.sync(keep, [])  # rolled back: the next forward sees the same context
    return seconds, logits


def compare(name: str, dtype: torch.dtype, widths: list[int], steps: int, context: int) -> dict:
    runners = {copy: _runner(name, dtype, copy == "fused", context) for copy in COPIES}
    result: dict = {}
    for width in widths:
        times: dict[str, list[float]] = {copy: [] for copy in COPIES}
        logits = {copy: _forward(*runners[copy], width)[1] for copy in COPIES}  # untimed first pass
        for step in range(steps):
            for copy in COPIES if step % 2 == 0 else COPIES[::-1]:
                times[copy].append(_forward(*runners[copy], width)[0])
        medians = {copy: statistics.median(t) for copy, t in times.items()}
        # Each pair ran back to back, so its ratio is free of the machine's slower drifts that medians over the
        # whole run still carry.
        paired = statistics.median(u / f for u, f in zip(times["unfused"], times["fused"], strict=True))
        diff = (logits["fused"].float() - logits["unfused"].float()).abs().max().item()
        result[str(width)] = {"fused_s": round(medians["fused"], 5), "unfused_s": round(medians["unfused"], 5),
                              "unfused_over_fused": round(paired, 4), "max_logit_diff": diff}
        print(f"{name} width {width}: fused {medians['fused'] * 1e3:.1f} ms, unfused {medians['unfused'] * 1e3:.1f} ms,"
              f" {result[str(width)]['unfused_over_fused']:.3f}x", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    add_bench_model_options(parser, "bfloat16", "both models' dtype (one oneDNN packs here)")
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 5], help="tokens per forward")
    parser.add_argument("--steps", type=int, default=60, help="alternated pairs of forwards per width")
    parser.add_argument("--context", type=int, default=300, help="tokens cached before the timed forwards")
    add_json_option(parser, "the report")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if not supported(dtype):
        parser.error(f"oneDNN cannot pack {args.dtype} weights on this CPU: nothing to compare")
    report: dict = {"config": {"target": args.target, "draft": args.draft, "dtype": args.dtype, "threads": args.threads,
                               "steps": args.steps, "context": args.context, "torch": torch.__version__,
                               "machine": platform.processor() or platform.machine()}}
    for role in ("target", "draft"):
        report[role] = compare(getattr(args, role), dtype, args.widths, args.steps, args.context)
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
