"""N requests at once in one process: plain decoding against AUTO (and a fixed k), alternated, with what was drafted.

The real pair in bf16 on the CPU, the shipped prompts through the chat template, greedy. Each repeat runs every
engine over every prompt at once (plain, AUTO, then fixed k; the next repeat in the reverse order), after a short
warm-up batch each; the AUTO engine's calibrated costs are reported before and after. A fixed k is the yardstick for
the batch plan: AUTO should come close to the best fixed k without being told it. With --prompt-lookup, both
plain and AUTO run also with prompt lookup (core.prompt_lookup; AUTO's measured costs shared), each against its own
engine without it. One JSON out.

    python -m tandem.bench.at_once --repeats 3 --fixed-k 4 --draft-quantization w8a8 --json at-once.json
    python -m tandem.bench.at_once --prompt-lookup --json at-once-lookup.json
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from tandem.bench.prompts import DEFAULT_PROMPTS, PROMPT_SETS, load_prompts
from tandem.bench.vllm_compare_tandem import batched
from tandem.cli.common import DEFAULT_DRAFT, DEFAULT_TARGET
from tandem.cli.options import DefaultsHelpFormatter, add_json_option, add_prompts_option, wants_text, write_json
from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.core.model_options import QUANTIZATIONS
from tandem.engines.local import build_engine, encode_prompt
from tandem.models.loader import load_pair

TARGET, DRAFT = DEFAULT_TARGET, DEFAULT_DRAFT


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2, help="runs of every engine, the order reversed each repeat")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per request")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--fixed-k", type=int, default=0, help="also run an engine drafting this many tokens every "
                        "round (0: none)")
    parser.add_argument("--draft-quantization", choices=QUANTIZATIONS, default="none",
                        help="the draft's linear weights (core.w8a8_linear, core.int8_linear)")
    parser.add_argument("--prompt-lookup", action="store_true", help="also plain and AUTO with prompt lookup")
    add_prompts_option(parser, PROMPT_SETS, DEFAULT_PROMPTS)
    add_json_option(parser, "the report")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    draft, target = load_pair(DRAFT, TARGET, device=torch.device("cpu"), dtype=torch.bfloat16, progress=False,
                              draft_quantization=args.draft_quantization)
    ids = [encode_prompt(target.tokenizer, text, chat=True) for text in load_prompts(args.prompts)]
    engines = {"plain": build_engine(target, None, EngineConfig(calibrate=False)),
               "auto": build_engine(target, draft, EngineConfig())}
    if args.fixed_k:
        fixed = SpecConfig(adaptive=False, k_init=args.fixed_k, k_max=max(args.fixed_k, SpecConfig().k_max))
        engines[f"k{args.fixed_k}"] = build_engine(target, draft, EngineConfig(spec=fixed))
    if args.prompt_lookup:
        lookup = EngineConfig(spec=SpecConfig(prompt_lookup=True))
        engines["plain+lookup"] = build_engine(target, None, lookup)  # its target's forwards timed
        engines["auto+lookup"] = build_engine(target, draft, dataclasses.replace(lookup, calibrate=False),
                                              costs=engines["auto"].costs)
    report: dict = {"target": TARGET, "draft": DRAFT, "dtype": "bfloat16", "requests_at_once": len(ids),
                    "tokens": args.tokens, "threads": args.threads, "draft_quantization": args.draft_quantization,
                    "calibrated_costs": engines["auto"].costs.to_dict(), "runs": []}
    for engine in engines.values():
        engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=4))
    outputs: dict[str, list] = {}
    for repeat in range(args.repeats):
        for name in list(engines) if repeat % 2 == 0 else list(engines)[::-1]:
            run = batched(engines[name], ids, args.tokens)
            outputs[name] = run.pop("outputs")
            report["runs"].append({"engine": name, "repeat": repeat} | run)
            if wants_text(args):
                print(f"{name}: {run}", flush=True)
    for name in engines:
        runs = [r for r in report["runs"] if r["engine"] == name]
        report[name] = {"tok_s": round(sum(r["tokens"] for r in runs) / sum(r["seconds"] for r in runs), 2)}
    for name in list(engines)[1:]:
        report[f"{name}_vs_plain"] = round(report[name]["tok_s"] / report["plain"]["tok_s"], 3)
        report[f"{name}_vs_plain_by_repeat"] = _paired(report["runs"], name)
    for name in ("plain", "auto") if args.prompt_lookup else ():
        report[f"{name}+lookup_vs_{name}"] = round(report[f"{name}+lookup"]["tok_s"] / report[name]["tok_s"], 3)
        report[f"{name}+lookup_vs_{name}_by_repeat"] = _paired(report["runs"], f"{name}+lookup", name)
    report["greedy_identical"] = {name: sum(a == b for a, b in zip(outputs[name], outputs["plain"], strict=True))
                                  for name in list(engines)[1:]}
    report["costs_after"] = engines["auto"].costs.to_dict()
    write_json(args.json, report)


def _paired(runs: list[dict], name: str, over: str = "plain") -> list[float]:
    """Per repeat, the engine's tok/s over engine `over`'s in the same repeat."""
    tok_s = {(r["engine"], r["repeat"]): r["tok_s"] for r in runs}
    return [round(tok_s[name, repeat] / tok_s[over, repeat], 3) for engine, repeat in tok_s if engine == name]


if __name__ == "__main__":
    main()
