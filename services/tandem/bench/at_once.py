"""N requests at once in one process: plain decoding against AUTO, alternated, with what the batch plan drafted.

The real pair in bf16 on the CPU, the shipped prompts through the chat template, greedy. Each repeat runs both
engines over every prompt at once (plain then AUTO, the next repeat AUTO then plain), after a short warm-up batch
each; the AUTO engine's calibrated costs are reported before and after. One JSON out.

    python -m tandem.bench.at_once --repeats 2 --tokens 128 --json at-once.json
"""

from __future__ import annotations

import argparse

import torch

from tandem.bench.prompts import DEFAULT_PROMPTS, PROMPT_SETS, load_prompts
from tandem.bench.vllm_compare_tandem import batched
from tandem.cli.options import DefaultsHelpFormatter, add_json_option, add_prompts_option, wants_text, write_json
from tandem.core.config import EngineConfig, SamplingParams
from tandem.engines.local import build_engine, encode_prompt
from tandem.models.loader import load_pair

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2, help="plain/AUTO pairs, the order alternating")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per request")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    add_prompts_option(parser, PROMPT_SETS, DEFAULT_PROMPTS)
    add_json_option(parser, "the report")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    draft, target = load_pair(DRAFT, TARGET, device=torch.device("cpu"), dtype=torch.bfloat16, progress=False)
    ids = [encode_prompt(target.tokenizer, text, chat=True) for text in load_prompts(args.prompts)]
    engines = {"plain": build_engine(target, None, EngineConfig(calibrate=False)),
               "auto": build_engine(target, draft, EngineConfig())}
    report: dict = {"target": TARGET, "draft": DRAFT, "dtype": "bfloat16", "requests_at_once": len(ids),
                    "tokens": args.tokens, "threads": args.threads,
                    "calibrated_costs": engines["auto"].costs.to_dict(), "runs": []}
    for engine in engines.values():
        engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=4))
    outputs: dict[str, list] = {}
    for repeat in range(args.repeats):
        for name in ("plain", "auto") if repeat % 2 == 0 else ("auto", "plain"):
            run = batched(engines[name], ids, args.tokens)
            outputs[name] = run.pop("outputs")
            report["runs"].append({"engine": name, "repeat": repeat} | run)
            if wants_text(args):
                print(f"{name}: {run}", flush=True)
    for name in engines:
        runs = [r for r in report["runs"] if r["engine"] == name]
        report[name] = {"tok_s": round(sum(r["tokens"] for r in runs) / sum(r["seconds"] for r in runs), 2)}
    report["auto_vs_plain"] = round(report["auto"]["tok_s"] / report["plain"]["tok_s"], 3)
    report["greedy_identical"] = sum(a == b for a, b in zip(outputs["auto"], outputs["plain"], strict=True))
    report["costs_after"] = engines["auto"].costs.to_dict()
    write_json(args.json, report)


if __name__ == "__main__":
    main()
