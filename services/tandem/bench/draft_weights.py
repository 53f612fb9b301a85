"""The draft's weights as loaded against int8, one sitting: what drafting costs and what it gains.

Engines over one target: plain decoding, AUTO with the draft as loaded, AUTO with an int8 copy of it (core.int8_linear,
activations in the model's dtype) and, where oneDNN runs int8 GEMMs, AUTO with a w8a8 copy (core.w8a8_linear) and with
a w4 one (core.w4_linear; where the int4 CPU kernel runs too). `--methods` picks some of them, `--compile` compiles
every runner's decode forwards (as serving's `--compile`), `--draft-vocab` limits what each draft scores. Greedy,
batch 1, the chat-templated prompts one by one, the methods in a rotating order per prompt so a slow spell of the
machine hits all alike. Per method: tokens, seconds (prefill included), tok/s, and for AUTO the acceptance rate,
rounds by k and the calibrated cost of a draft step and of verify forwards by width. Before the engines, the cost
of one [8960 x 1536] linear layer (the target's MLP shape) at 1, 2, 5 and 64 rows in the kernels this CPU offers:
the model's dtype through PyTorch, int8 weights, float32 weights prepacked for oneDNN.

    python -m tandem.bench.draft_weights --num-prompts 4 --max-tokens 48 --json draft-weights.json
    python -m tandem.bench.draft_weights --methods plain auto_w8a8 auto_w4 --compile --draft-vocab 65536 --json w4.json
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from tandem.bench.prompts import DEFAULT_PROMPTS, PROMPT_SETS, load_prompts
from tandem.cli.common import add_bench_model_options
from tandem.cli.options import DefaultsHelpFormatter, add_json_option, add_prompts_option, write_json
from tandem.core import bf16_linear
from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.core.int8_linear import Int8Linear
from tandem.core.packed_linear import PackedLinear, supported, weight_bytes
from tandem.core.w4_linear import supported as w4_supported
from tandem.core.w8a8_linear import W8A8Linear
from tandem.core.w8a8_linear import supported as w8a8_supported
from tandem.engines.local import build_engine, encode_prompt
from tandem.models.loader import LoadedModel, load_model

METHODS = ("plain", "auto", "auto_int8", "auto_w8a8", "auto_w4")
# How each AUTO method's draft is held.
DRAFT_QUANTIZATION = {"auto": "none", "auto_int8": "int8", "auto_w8a8": "w8a8", "auto_w4": "w4"}
ROWS = (1, 2, 5, 64)


def _ms(call, passes: int = 5) -> float:
    call()
    best = float("inf")
    for _ in range(passes):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return round(best * 1e3, 2)


def linear_kernels(dtype: torch.dtype, out_features: int = 8960, in_features: int = 1536) -> dict:
    """Milliseconds of one linear layer per row count, in each kernel: the shape of the CPU's fast path."""
    linear = torch.nn.Linear(in_features, out_features, bias=False, dtype=dtype)
    kernels = {str(dtype).removeprefix("torch."): linear, "int8": Int8Linear.from_linear(linear),
               "float32_onednn_packed": PackedLinear(linear.weight.detach().float(), None)}
    if dtype == torch.bfloat16 and supported():
        with bf16_linear.enabled(False):
            kernels["bfloat16_onednn_packed"] = PackedLinear.from_linear(linear)
        if bf16_linear.fits(linear.weight):
            kernels["bfloat16_tandem_kernel"] = PackedLinear.from_linear(linear)
    if w8a8_supported():
        kernels["w8a8_onednn"] = W8A8Linear.from_linear(linear)
    out: dict = {}
    with torch.inference_mode():
        for name, layer in kernels.items():
            act = torch.float32 if name.startswith("float32") else dtype
            inputs = {rows: torch.randn(rows, in_features, dtype=act) for rows in ROWS}
            out[name] = {rows: _ms(lambda layer=layer, x=x: layer(x)) for rows, x in inputs.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    add_bench_model_options(parser, "bfloat16")
    add_prompts_option(parser, PROMPT_SETS, DEFAULT_PROMPTS)
    parser.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts (default: all)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per request")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                        help="the engines to run (plain always runs: the others are compared with it)")
    parser.add_argument("--compile", action="store_true", help="compile every runner's decode forwards")
    parser.add_argument("--draft-vocab", type=int, default=0, help="drafts score only the first N ids (0: all)")
    add_json_option(parser, "the report")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    report: dict = {"config": {"target": args.target, "draft": args.draft, "dtype": args.dtype,
                               "threads": args.threads, "max_tokens": args.max_tokens, "compile": args.compile,
                               "draft_vocab": args.draft_vocab, "torch": torch.__version__,
                               "machine": platform.processor() or platform.machine(),
                               "bf16_packing": supported()}}
    report["linear_ms"] = linear_kernels(dtype)
    cpu = torch.device("cpu")
    target = load_model(args.target, device=cpu, dtype=dtype, progress=False, compile=args.compile)
    runs_here = {"auto_w8a8": w8a8_supported(), "auto_w4": w4_supported()}
    methods = ["plain", *(m for m in METHODS[1:] if m in args.methods and runs_here.get(m, True))]
    drafts = {name: load_model(args.draft, device=cpu, dtype=dtype, progress=False,
                               quantization=DRAFT_QUANTIZATION[name], compile=args.compile)
              for name in methods[1:]}
    report["config"]["weight_bytes"] = {"target": weight_bytes(target.model)} | {
        name: weight_bytes(draft.model) for name, draft in drafts.items()}
    prompts = [encode_prompt(target.tokenizer, text, chat=True)
               for text in load_prompts(args.prompts)[: args.num_prompts]]
    report |= compare_engines(target, drafts, prompts, args.max_tokens, args.draft_vocab)
    write_json(args.json, report)
    print_runs(report)
    return 0


def print_runs(report: dict) -> None:
    """One line per engine of a report holding compare_engines' runs."""
    for name, run in report.items():
        if isinstance(run, dict) and "tok_s" in run:
            print(f"{name:18s} {run['tok_s']:6.2f} tok/s  {run['vs_plain']:.3f}x plain  acceptance "
                  f"{run.get('acceptance')}  draft step {run.get('draft_step_ms')} ms", flush=True)


def compare_engines(target: LoadedModel, drafts: dict[str, LoadedModel], prompts: list[list[int]],
                    max_tokens: int, draft_vocab: int = 0) -> dict[str, dict]:
    """Plain decoding and AUTO with each draft, batch 1, greedy, the prompts one by one with the engines in a
    rotating order per prompt: per engine its tokens, seconds, tok/s, outputs equal to plain's and ratio to plain;
    for AUTO its acceptance, rounds by k and calibrated step costs."""
    one_row = EngineConfig(max_batch=1, spec=SpecConfig(draft_vocab=draft_vocab))
    engines = {"plain": build_engine(target, None, EngineConfig(spec=SpecConfig(enabled=False), max_batch=1))}
    engines |= {name: build_engine(target, draft, one_row) for name, draft in drafts.items()}
    names = list(engines)
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for engine in engines.values():  # warm-up, untimed
        engine.generate([prompts[0][:8]], SamplingParams(temperature=0.0, max_tokens=4))
    runs = {name: {"tokens": 0, "seconds": 0.0, "outputs": [], "stats": []} for name in names}
    for i, ids in enumerate(prompts):
        for name in names[i % len(names):] + names[: i % len(names)]:
            started = time.perf_counter()
            result = engines[name].generate([ids], greedy)[0]
            runs[name]["seconds"] += time.perf_counter() - started
            runs[name]["tokens"] += len(result.token_ids)
            runs[name]["outputs"].append(result.token_ids)
            runs[name]["stats"].append(result.stats)
    for name, run in runs.items():
        run["tok_s"] = round(run["tokens"] / run["seconds"], 3)
        run["seconds"] = round(run["seconds"], 2)
        run["same_as_plain"] = sum(a == b for a, b in zip(run["outputs"], runs["plain"]["outputs"], strict=True))
        if name != "plain":
            drafted = sum(s["drafted"] for s in run["stats"])
            run["acceptance"] = round(sum(s["accepted"] for s in run["stats"]) / drafted, 4) if drafted else None
            run["rounds_by_k"] = _summed(s["rounds_by_k"] for s in run["stats"])
            costs = engines[name].costs
            run["draft_step_ms"] = round(costs.draft_step * 1e3, 1)
            run["forward_ms_by_width"] = {w: round(costs.forward_time(w) * 1e3, 1) for w in range(1, 7)}
        del run["stats"]
    return {name: run | {"vs_plain": round(run["tok_s"] / runs["plain"]["tok_s"], 3)} for name, run in runs.items()}


def _summed(dicts) -> dict:
    total: dict = {}
    for d in dicts:
        for key, value in d.items():
            total[key] = total.get(key, 0) + value
    return total


if __name__ == "__main__":
    raise SystemExit(main())
