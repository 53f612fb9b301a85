"""Two ways of running the same forward, forward by forward in one sitting: fused projections, compiled forwards, or
a quantized draft.

`--compare fusion`: each model of the pair loaded twice, prepacked with and without fusing q/k/v and gate/up
(core.fused_linear). `--compare compile`: each model loaded once, run by an eager runner and by one whose decode
forwards torch.compile compiled (on a CPU: the static forwards without CUDA graphs). `--compare w8a8`: the draft
only, loaded as is and with `--draft-quantization w8a8` (core.w8a8_linear); `--compare w4`: the draft only, with
`--draft-quantization w4` (core.w4_linear) and w8a8. `--compare linear`: each model loaded twice, its bf16 layers
on tandem's own product (core.bf16_linear) and on oneDNN's. `--compare dtype`: each model loaded in bf16 and in
float32 as the loader prepares it (`--dtype` aside), which on an AVX2 CPU is tandem's product against oneDNN's float32
one, `--dtype auto`'s pick there. `--compare path`: each model loaded once, its products on tandem's kernel by
AVX512-BF16 dot products and by float32 multiply-adds (a CPU with both). `--compiled` compiles both runners of a
comparison (as `--compile` does for serving). Each runner holds `--rows` sequences of the same context; forwards of
each width then alternate between the two (A B, then B A) for `--steps` pairs, each feeding `width` tokens to every
row at the context's end and rolled back, so every forward sees the same context. Reported per model and width: the
median seconds of each, the speed-up of the first over the second (the median of each back-to-back pair's ratio,
free of the machine's slower drifts; above 1: the first is faster), the first forward's seconds (a compile), and the
largest difference between their logits.

    python -m tandem.bench.forward_ab --compare fusion --json fusion.json      # about 2 min on a 2-core CPU
    python -m tandem.bench.forward_ab --compare compile --json compile.json    # plus a compile per model and width
    python -m tandem.bench.forward_ab --compare w8a8 --json w8a8.json          # about 1 min
    python -m tandem.bench.forward_ab --compare w4 --compiled --widths 1 2 --json w4.json   # plus 2 compiles
    python -m tandem.bench.forward_ab --compare linear --rows 8 --widths 1 3 --json linear.json
    python -m tandem.bench.forward_ab --compare dtype --widths 1 3 5 --steps 10 --json dtype.json
    python -m tandem.bench.forward_ab --compare path --rows 8 --widths 1 2 3 --json path.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from contextlib import nullcontext
from typing import TextIO

import torch

from tandem.bench.packing import packable_dtype
from tandem.cli.common import add_bench_model_options
from tandem.cli.options import DefaultsHelpFormatter, add_json_option, wants_text, write_json
from tandem.core import bf16_linear
from tandem.core.packed_linear import prepack
from tandem.core.runner import ModelRunner
from tandem.models.loader import load_model

VARIANTS = {"fusion": ("fused", "unfused"), "compile": ("compiled", "eager"), "w8a8": ("w8a8", "as_loaded"),
            "w4": ("w4", "w8a8"), "linear": ("kernel", "onednn"), "dtype": ("bfloat16", "float32"),
            "path": ("dot", "fma")}
PATHS = {"dot": bf16_linear.DOT, "fma": 512}  # the kernel's path, by variant of --compare path
QUANTIZATION = {"w8a8": "w8a8", "as_loaded": "none", "w4": "w4"}  # the draft's, by variant of a quantization compare


def _ids(count: int, vocab: int, offset: int = 0) -> list[int]:
    return [(offset + 7 + 13 * i) % vocab for i in range(count)]


def _runners(compare: str, name: str, dtype: torch.dtype, context: int, compiled: bool = False,
             rows: int = 1) -> dict:
    first, second = VARIANTS[compare]
    if compare == "linear":
        models = {}
        for variant in (first, second):
            loaded = load_model(name, device=torch.device("cpu"), dtype=dtype, progress=False, eager=True)
            with bf16_linear.enabled(variant == first):
                prepack(loaded.model)
            models[variant] = ModelRunner(loaded.model, compile=compiled)
    elif compare == "fusion":
        models = {}
        for variant in (first, second):
            loaded = load_model(name, device=torch.device("cpu"), dtype=dtype, progress=False, eager=True)
            prepack(loaded.model, fuse_siblings=variant == first)
            models[variant] = ModelRunner(loaded.model, compile=compiled)
    elif compare == "dtype":
        models = {variant: ModelRunner(load_model(name, device=torch.device("cpu"), dtype=getattr(torch, variant),
                                                  progress=False).model, compile=compiled)
                  for variant in (first, second)}
    elif compare in ("w8a8", "w4"):
        models = {variant: ModelRunner(load_model(name, device=torch.device("cpu"), dtype=dtype, progress=False,
                                                  quantization=QUANTIZATION[variant]).model, compile=compiled)
                  for variant in (first, second)}
    elif compare == "path":
        model = load_model(name, device=torch.device("cpu"), dtype=dtype, progress=False).model
        models = {variant: ModelRunner(model, compile=compiled) for variant in (first, second)}
    else:
        model = load_model(name, device=torch.device("cpu"), dtype=dtype, progress=False).model
        models = {first: ModelRunner(model, compile=True), second: ModelRunner(model, compile=False)}
    runners = {}
    for variant, runner in models.items():
        states = [runner.state(f"bench{row}") for row in range(rows)]
        for state in states:
            state.sync(0, _ids(context, runner.vocab_size))
            runner.prefill(state, context)
        runners[variant] = (runner, states)
    return runners


def _forward(runner: ModelRunner, states: list, width: int) -> tuple[float, torch.Tensor]:
    keep = len(states[0].tokens)
    for state in states:
        state.sync(keep, _ids(width, runner.vocab_size, offset=keep))
    started = time.perf_counter()
    logits = runner.forward_on_device(states, [width] * len(states))
    seconds = time.perf_counter() - started
    for state in states:
        state.sync(keep, [])  # rolled back: the next forward sees the same context
    return seconds, logits


def compare_forwards(compare: str, name: str, dtype: torch.dtype, widths: list[int], steps: int,
                     context: int, compiled: bool = False, progress: TextIO | None = None, rows: int = 1) -> dict:
    """progress: where a line per width goes as it is measured (None: stdout)."""
    if compare == "path" and not (bf16_linear.ready() and bf16_linear.runs_dot()):
        raise SystemExit("--compare path: the kernel's dot-product path does not run on this CPU")
    runners = _runners(compare, name, dtype, context, compiled, rows)
    first, second = VARIANTS[compare]

    def on_path(variant: str):  # the kernel's path for this variant's forwards (--compare path)
        return bf16_linear.isa(PATHS[variant]) if compare == "path" else nullcontext()

    result: dict = {}
    for width in widths:
        firsts, logits = {}, {}
        for variant, (runner, state) in runners.items():  # untimed in the pairs: it may compile
            with on_path(variant):
                firsts[variant], logits[variant] = _forward(runner, state, width)
        times: dict[str, list[float]] = {variant: [] for variant in runners}
        for step in range(steps):
            for variant in (first, second) if step % 2 == 0 else (second, first):
                with on_path(variant):
                    times[variant].append(_forward(*runners[variant], width)[0])
        paired = statistics.median(b / a for a, b in zip(times[first], times[second], strict=True))
        result[str(width)] = {
            **{f"{variant}_s": round(statistics.median(t), 5) for variant, t in times.items()},
            "speedup": round(paired, 4),
            "first_forward_s": {variant: round(seconds, 3) for variant, seconds in firsts.items()},
            "max_logit_diff": (logits[first].float() - logits[second].float()).abs().max().item(),
        }
        print(f"{name} width {width}: {first} {result[str(width)][first + '_s'] * 1e3:.1f} ms, {second} "
              f"{result[str(width)][second + '_s'] * 1e3:.1f} ms, {first} {paired:.3f}x", file=progress, flush=True)
    if compare == "compile" or compiled:  # whether every runner meant to compile did
        meant = [runners[first][0]] if compare == "compile" else [runner for runner, _ in runners.values()]
        result["compiled"] = all(runner.graphs is not None and runner.graphs.compiled for runner in meant)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--compare", choices=sorted(VARIANTS), default="fusion", help="what the two runners differ in")
    add_bench_model_options(parser, "bfloat16", "both models' dtype (one oneDNN packs here)")
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 5], help="tokens per forward")
    parser.add_argument("--steps", type=int, default=60, help="alternated pairs of forwards per width")
    parser.add_argument("--context", type=int, default=300, help="tokens cached before the timed forwards")
    parser.add_argument("--rows", type=int, default=1, help="sequences each forward feeds (every one `width` tokens)")
    parser.add_argument("--compiled", action="store_true",
                        help="compile both runners' decode forwards (torch.compile, as --compile does when serving)")
    add_json_option(parser, "the report")
    args = parser.parse_args(argv)
    dtype = packable_dtype(parser, args, onednn=args.compare == "linear")
    if args.compare == "dtype":
        args.dtype = "bfloat16 and float32"
    report: dict = {"config": {"compare": args.compare, "variants": VARIANTS[args.compare], "target": args.target,
                               "draft": args.draft, "dtype": args.dtype, "threads": args.threads,
                               "steps": args.steps, "context": args.context, "compiled": args.compiled,
                               "rows": args.rows, "torch": torch.__version__,
                               "machine": platform.processor() or platform.machine()}}
    quantized = args.compare in ("w8a8", "w4")  # a target is never quantized
    # With the JSON on stdout, stdout holds it alone; the progress lines (minutes apart on a CPU) go to stderr.
    progress = None if wants_text(args) else sys.stderr
    for role in ("draft",) if quantized else ("target", "draft"):
        report[role] = compare_forwards(args.compare, getattr(args, role), dtype, args.widths, args.steps,
                                        args.context, args.compiled, progress, args.rows)
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
