"""Serving benchmark: tok/s of one session and of N concurrent sessions against a running `tandem serve`.

    python -m tandem.bench.serving --address 127.0.0.1:50051 --concurrency 1 8 --max-tokens 64 --json out.json

Each level runs the prompt set (at least `concurrency` requests) with at most `concurrency` in flight, once with
speculation AUTO and once OFF (plain decoding through the same server), so the JSON holds
aggregate tok/s per level and mode, and the ratios the targets are stated in. With `--in-process TARGET DRAFT`, the
same prompts also run one at a time through an engine in this process (while the server idles), interleaved with
the served runs at concurrency 1, for the served / in-process ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import TYPE_CHECKING

from tandem.bench.prompts import DEFAULT_PROMPTS, PROMPT_SETS, load_prompts
from tandem.cli.options import (
    DefaultsHelpFormatter,
    add_json_option,
    add_prompts_option,
    at_least,
    refuse_bad_values,
    wants_text,
    write_json,
)
from tandem.client import AsyncTandemClient
from tandem.client.channel import DEFAULT_ADDRESS

if TYPE_CHECKING:
    from tandem.models.loader import LoadedModel


async def _one(client: AsyncTandemClient, prompt: str, max_tokens: int, speculation: str, session: str) -> dict:
    tokens = 0
    final = None
    async for item in client.generate(chat=[{"role": "user", "content": prompt}], temperature=0.0,
                                      max_tokens=max_tokens, speculation=speculation, session_id=session):
        tokens += len(getattr(item, "token_ids", []))
        final = item
    stats = final.speculation
    return {"tokens": tokens, "accepted": stats.accepted_tokens, "drafted": stats.drafted_tokens,
            "rounds": stats.rounds, "fallback_rounds": stats.fallback_rounds, "draft_failures": stats.draft_failures}


async def run_level(address: str, prompts: list[str], concurrency: int, max_tokens: int, speculation: str,
                    repetition: int = 0) -> dict:
    """One level and mode; every request is a new session (no cache from an earlier run to reuse)."""
    client = AsyncTandemClient(address, timeout=1800)
    try:
        await _one(client, prompts[0], 4, speculation, "warmup")
        jobs = [prompts[i % len(prompts)] for i in range(max(concurrency, len(prompts)))]
        slots = asyncio.Semaphore(concurrency)

        async def job(i: int, prompt: str) -> dict:
            async with slots:
                session = f"{speculation}-{concurrency}-{repetition}-{i}"
                return await _one(client, prompt, max_tokens, speculation, session)

        started = time.perf_counter()
        results = await asyncio.gather(*[job(i, p) for i, p in enumerate(jobs)])
        seconds = time.perf_counter() - started
    finally:
        await client.close()
    tokens = sum(r["tokens"] for r in results)
    drafted = sum(r["drafted"] for r in results)
    return {"concurrency": concurrency, "speculation": speculation, "tokens": tokens, "seconds": round(seconds, 3),
            "tok_s": round(tokens / seconds, 3),
            "alpha": round(sum(r["accepted"] for r in results) / drafted, 4) if drafted else None,  # none drafted
            "rounds": sum(r["rounds"] for r in results), "fallback_rounds": sum(r["fallback_rounds"] for r in results),
            "draft_failures": sum(r["draft_failures"] for r in results)}


async def run(address: str, prompts: list[str], levels: list[int], max_tokens: int, repeat: int = 1,
              in_process: InProcess | None = None) -> dict:
    """Each level runs AUTO and OFF (and at concurrency 1 the in-process engine, when given) `repeat` times, the
    order reversed on every other repetition so a slow spell of the machine does not favour one mode; a mode's tok/s
    is its tokens over its seconds."""
    report: dict = {"address": address, "max_tokens": max_tokens, "repeat": repeat, "levels": []}
    for concurrency in levels:
        modes = ["auto", "off"] + (["in-process"] if in_process and concurrency == 1 else [])
        runs: dict[str, list[dict]] = {mode: [] for mode in modes}
        for repetition in range(repeat):
            for mode in modes if repetition % 2 == 0 else modes[::-1]:
                if mode == "in-process":
                    runs[mode].append(in_process.run(prompts, max_tokens))
                else:
                    runs[mode].append(await run_level(address, prompts, concurrency, max_tokens, mode, repetition))
        combined = {mode: _combine(results) for mode, results in runs.items()}
        report["levels"] += combined.values()
        if "in-process" in runs:
            report["served_vs_in_process_at_1"] = round(combined["auto"]["tok_s"] / combined["in-process"]["tok_s"], 3)
            report["served_vs_in_process_each"] = [round(a["tok_s"] / b["tok_s"], 3)
                                                   for a, b in zip(runs["auto"], runs["in-process"], strict=True)]
    by = {(r["concurrency"], r["speculation"]): r["tok_s"] for r in report["levels"]}
    single = by.get((levels[0], "auto"))
    for concurrency in levels[1:]:
        report[f"auto_{concurrency}_vs_auto_{levels[0]}"] = round(by[(concurrency, "auto")] / single, 3)
    for concurrency in levels:
        report[f"auto_vs_off_at_{concurrency}"] = round(by[(concurrency, "auto")] / by[(concurrency, "off")], 3)
    return report


def _combine(results: list[dict]) -> dict:
    first, total = results[0], {}
    for key in ("tokens", "seconds", "rounds", "fallback_rounds", "draft_failures"):
        total[key] = round(sum(r[key] for r in results), 3)
    # An acceptance rate only where something was drafted: a plain run has none (0.0 read as all rejected).
    alphas = [r["alpha"] for r in results if r["alpha"] is not None]
    return {"concurrency": first["concurrency"], "speculation": first["speculation"], **total,
            "tok_s": round(total["tokens"] / total["seconds"], 3),
            "alpha": round(sum(alphas) / len(alphas), 4) if alphas else None,
            "tok_s_each": [r["tok_s"] for r in results]}


class InProcess:
    """The same prompts, one at a time, through an engine in this process (bf16, CPU) while the server idles."""

    def __init__(self, target: LoadedModel, draft: LoadedModel) -> None:
        from tandem.core.config import EngineConfig
        from tandem.engines.local import build_engine

        self.tokenizer = target.tokenizer
        self.engine = build_engine(target, draft, EngineConfig())

    @classmethod
    def load(cls, target: str, draft: str, threads: int) -> InProcess:
        import torch

        from tandem.models.loader import load_model

        torch.set_num_threads(threads)
        return cls(*(load_model(name, device=torch.device("cpu"), dtype=torch.bfloat16, progress=False)
                     for name in (target, draft)))

    def run(self, prompts: list[str], max_tokens: int) -> dict:
        from tandem.core.config import SamplingParams
        from tandem.engines.local import encode_prompt

        encoded = [encode_prompt(self.tokenizer, prompt, chat=True) for prompt in prompts]
        self.engine.generate([encoded[0]], SamplingParams(temperature=0.0, max_tokens=4))
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        started = time.perf_counter()
        results = [self.engine.generate([ids], params)[0] for ids in encoded]
        seconds = time.perf_counter() - started
        tokens = sum(len(r.token_ids) for r in results)
        drafted = sum(r.stats["drafted"] for r in results)
        return {"concurrency": 1, "speculation": "in-process", "tokens": tokens, "seconds": round(seconds, 3),
                "tok_s": round(tokens / seconds, 3),
                "alpha": round(sum(r.stats["accepted"] for r in results) / drafted, 4) if drafted else None,
                "rounds": sum(r.stats["rounds"] for r in results),
                "fallback_rounds": sum(r.stats["fallback_rounds"] for r in results), "draft_failures": 0}


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse bad values before any request (concurrency 0 waited forever for a slot): one line naming the flag,
    exit status 2, as the tandem CLI does."""
    refuse_bad_values(parser, at_least(args, concurrency=1, max_tokens=1, repeat=1, threads=1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--address", default=DEFAULT_ADDRESS, help="the server's HOST:PORT")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="levels: requests in flight at once")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    add_prompts_option(parser, PROMPT_SETS, DEFAULT_PROMPTS)
    add_json_option(parser, "the report")
    parser.add_argument("--in-process", nargs=2, metavar=("TARGET", "DRAFT"), default=None,
                        help="also run the prompts through an in-process engine on these models (bf16, CPU)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for --in-process")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each level and mode, interleaved")
    args = parser.parse_args(argv)
    _check_args(parser, args)
    prompts = load_prompts(args.prompts)
    in_process = InProcess.load(*args.in_process, args.threads) if args.in_process else None
    report = asyncio.run(run(args.address, prompts, args.concurrency, args.max_tokens, args.repeat, in_process))
    if wants_text(args):
        print(json.dumps(report, indent=2))
    write_json(args.json, report)


if __name__ == "__main__":
    main()
