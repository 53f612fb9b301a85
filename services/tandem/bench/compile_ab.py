"""Compiled against eager decoding end to end (`--compile` on a CPU), one sitting: plain and AUTO, batch 1 and N.

The real pair is loaded once (bf16 on the CPU, prepacked); four engines run over it: plain and AUTO, each once with
eager runners and once with runners whose decode forwards torch.compile compiled. The compiled engines warm up first
(every class of shape compiled; the seconds are reported) and each engine decodes a short untimed request before
anything is timed; each AUTO engine calibrates its own costs, so the compiled one plans its rounds with its own
(cheaper) forwards.
- batch 1: prompt by prompt, each prompt through the eager and the compiled engine of a kind back to back, the order
  alternating per prompt. Reported: tok/s pooled over the prompts, and the median of the per-prompt ratios (what this
  machine's slow drifts disturb least).
- N at once (`--at-once`): every prompt in one generate call, eager and compiled alternated over `--repeats`.
Greedy, the shipped prompts through the chat template; whether the compiled engines' tokens equal the eager ones' is
reported beside (bf16: compiled kernels round differently, so near-ties may part). `--compiled draft` compiles the
draft's runner alone (`--compile-draft`), so only AUTO is compared (a plain engine runs no draft).

    python -m tandem.bench.compile_ab --json compile-ab.json        # 20-30 min on a 2-core CPU, compiling included
    python -m tandem.bench.compile_ab --compiled draft --draft-quantization w8a8 --no-at-once --json draft.json
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import time

import torch

from tandem.bench.prompts import DEFAULT_PROMPTS, PROMPT_SETS, load_prompts
from tandem.bench.vllm_compare_tandem import batched
from tandem.cli.common import add_bench_model_options
from tandem.cli.options import DefaultsHelpFormatter, add_json_option, add_prompts_option, write_json
from tandem.core.config import EngineConfig, SamplingParams
from tandem.core.model_options import COMPILE_SCOPES, QUANTIZATIONS, compiles
from tandem.engines.local import build_engine, encode_prompt
from tandem.models.loader import load_pair

VARIANTS = ("eager", "compiled")


def _engines(target, draft, scope: str, kinds: list[str]) -> tuple[dict, float]:
    """{(kind, variant): engine} and the seconds the compiled engines took to build (their warm-up compiles); the
    compiled variant compiles the models `scope` names (core.model_options.COMPILE_SCOPES)."""
    engines, compiling = {}, 0.0
    for variant in VARIANTS:
        scoped = scope if variant == "compiled" else "none"
        pair = [dataclasses.replace(m, compile=compiles(scoped, draft=m is draft)) for m in (target, draft)]
        started = time.perf_counter()
        if "plain" in kinds:
            engines["plain", variant] = build_engine(pair[0], None, EngineConfig(calibrate=False))
        if "auto" in kinds:
            engines["auto", variant] = build_engine(pair[0], pair[1], EngineConfig())
        if variant == "compiled":
            compiling = time.perf_counter() - started
    return engines, compiling


def one_at_a_time(engines: dict, kind: str, ids: list[list[int]], max_tokens: int) -> dict:
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    tokens = {v: 0 for v in VARIANTS}
    seconds = {v: 0.0 for v in VARIANTS}
    outputs: dict[str, list] = {v: [] for v in VARIANTS}
    drafted = {v: [0, 0] for v in VARIANTS}  # drafted, accepted
    ratios = []
    for index, prompt in enumerate(ids):
        rates = {}
        for variant in VARIANTS if index % 2 == 0 else VARIANTS[::-1]:
            started = time.perf_counter()
            result = engines[kind, variant].generate([prompt], greedy)[0]
            elapsed = time.perf_counter() - started
            tokens[variant] += len(result.token_ids)
            seconds[variant] += elapsed
            outputs[variant].append(list(result.token_ids))
            drafted[variant][0] += result.stats["drafted"]
            drafted[variant][1] += result.stats["accepted"]
            rates[variant] = len(result.token_ids) / elapsed
        ratios.append(rates["compiled"] / rates["eager"])
        print(f"{kind} b1 prompt {index}: compiled/eager {ratios[-1]:.3f}x", flush=True)
    report = {f"{v}_tok_s": round(tokens[v] / seconds[v], 3) for v in VARIANTS}
    return report | {"compiled_over_eager": round(report["compiled_tok_s"] / report["eager_tok_s"], 4),
                     "median_prompt_ratio": round(statistics.median(ratios), 4),
                     "prompt_ratios": [round(r, 4) for r in ratios],
                     "drafted": {v: d for v, (d, _) in drafted.items()},
                     "alpha": {v: round(a / d, 4) if d else 0.0 for v, (d, a) in drafted.items()},
                     "identical": sum(a == b for a, b in zip(outputs["eager"], outputs["compiled"], strict=True))}


def all_at_once(engines: dict, kind: str, ids: list[list[int]], max_tokens: int, repeats: int) -> dict:
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for repeat in range(repeats):
        for variant in VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]:
            runs[variant].append(batched(engines[kind, variant], ids, max_tokens))
            print(f"{kind} b{len(ids)} {variant}: {runs[variant][-1]['tok_s']} tok/s", flush=True)
    pooled = {v: round(sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs), 3) for v, rs in runs.items()}
    identical = sum(a == b for a, b in zip(runs["eager"][0]["outputs"], runs["compiled"][0]["outputs"], strict=True))
    pairs = zip(runs["eager"], runs["compiled"], strict=True)
    return {f"{v}_tok_s": pooled[v] for v in VARIANTS} | {
        "compiled_over_eager": round(pooled["compiled"] / pooled["eager"], 4),
        "repeat_ratios": [round(c["tok_s"] / e["tok_s"], 4) for e, c in pairs], "identical": identical,
        # per repeat: at N rows the batch plan decides how much drafting pays, so a gain may come from drafting more
        "drafted": {v: [r["drafted"] for r in rs] for v, rs in runs.items()},
        "alpha": {v: [r["alpha"] for r in rs] for v, rs in runs.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    add_bench_model_options(parser, "bfloat16")
    add_prompts_option(parser, PROMPT_SETS, DEFAULT_PROMPTS)
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per request")
    parser.add_argument("--at-once", action=argparse.BooleanOptionalAction, default=True,
                        help="also every prompt at once")
    parser.add_argument("--repeats", type=int, default=2, help="eager/compiled pairs at once, the order alternating")
    parser.add_argument("--compiled", choices=COMPILE_SCOPES[1:], default="all",
                        help="whose decode forwards the compiled engines compile (draft: AUTO only)")
    parser.add_argument("--draft-quantization", choices=QUANTIZATIONS, default="none",
                        help="the draft's weights as `--draft-quantization` holds them")
    add_json_option(parser, "the report")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    draft, target = load_pair(args.draft, args.target, device=torch.device("cpu"), dtype=getattr(torch, args.dtype),
                              progress=False, draft_quantization=args.draft_quantization)
    ids = [encode_prompt(target.tokenizer, text, chat=True) for text in load_prompts(args.prompts)]
    kinds = ["auto"] if args.compiled == "draft" else ["plain", "auto"]
    engines, compiling = _engines(target, draft, args.compiled, kinds)
    for engine in engines.values():  # untimed: anything left to compile, and first-call costs
        engine.generate([ids[0]], SamplingParams(temperature=0.0, max_tokens=8))
    report: dict = {"config": {"target": args.target, "draft": args.draft, "dtype": args.dtype,
                               "threads": args.threads, "prompts": len(ids), "max_tokens": args.max_tokens,
                               "compiled": args.compiled, "draft_quantization": args.draft_quantization,
                               "torch": torch.__version__, "machine": platform.processor() or platform.machine()},
                    "compile_seconds": round(compiling, 1)}
    for kind in kinds:
        report[f"{kind}_b1"] = one_at_a_time(engines, kind, ids, args.max_tokens)
        if args.at_once:
            report[f"{kind}_b{len(ids)}"] = all_at_once(engines, kind, ids, args.max_tokens, args.repeats)
    report["auto_costs"] = {v: engines["auto", v].costs.to_dict() for v in VARIANTS}
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
