"""Serving benchmark: tok/s of one session and of N concurrent sessions against a running `tandem serve`.

    python -m tandem.bench.serving --address 127.0.0.1:50051 --concurrency 1 8 --max-tokens 64 --json out.json

Each level runs the prompt set (at least `concurrency` requests) with at most `concurrency` in flight, once with
speculation AUTO and once OFF (plain decoding through the same server), so the JSON holds
aggregate tok/s per level and mode, and the ratios the targets are stated in.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from tandem.bench.runner import load_prompts
from tandem.client import AsyncTandemClient


async def _one(client: AsyncTandemClient, prompt: str, max_tokens: int, speculation: str, session: str) -> dict:
    tokens = 0
    final = None
    async for item in client.generate(chat=[{"role": "user", "content": prompt}], temperature=0.0,
                                      max_tokens=max_tokens, speculation=speculation, session_id=session):
        tokens += len(getattr(item, "token_ids", []))
        final = item
    stats = final.speculation
    return {"tokens": tokens, "accepted": stats.accepted_tokens, "drafted": stats.drafted_tokens}


async def run_level(address: str, prompts: list[str], concurrency: int, max_tokens: int, speculation: str) -> dict:
    client = AsyncTandemClient(address, timeout=1800)
    try:
        await _one(client, prompts[0], 4, speculation, "warmup")
        jobs = [prompts[i % len(prompts)] for i in range(max(concurrency, len(prompts)))]
        slots = asyncio.Semaphore(concurrency)

        async def job(i: int, prompt: str) -> dict:
            async with slots:
                return await _one(client, prompt, max_tokens, speculation, f"{speculation}-{concurrency}-{i}")

        started = time.perf_counter()
        results = await asyncio.gather(*[job(i, p) for i, p in enumerate(jobs)])
        seconds = time.perf_counter() - started
    finally:
        await client.close()
    tokens = sum(r["tokens"] for r in results)
    drafted = sum(r["drafted"] for r in results)
    return {"concurrency": concurrency, "speculation": speculation, "tokens": tokens, "seconds": round(seconds, 3),
            "tok_s": round(tokens / seconds, 3),
            "alpha": round(sum(r["accepted"] for r in results) / drafted, 4) if drafted else 0.0}


async def run(address: str, prompts: list[str], levels: list[int], max_tokens: int) -> dict:
    report: dict = {"address": address, "max_tokens": max_tokens, "levels": []}
    for concurrency in levels:
        for mode in ("auto", "off"):
            report["levels"].append(await run_level(address, prompts, concurrency, max_tokens, mode))
    by = {(r["concurrency"], r["speculation"]): r["tok_s"] for r in report["levels"]}
    single = by.get((levels[0], "auto"))
    for concurrency in levels[1:]:
        report[f"auto_{concurrency}_vs_auto_{levels[0]}"] = round(by[(concurrency, "auto")] / single, 3)
    for concurrency in levels:
        report[f"auto_vs_off_at_{concurrency}"] = round(by[(concurrency, "auto")] / by[(concurrency, "off")], 3)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    report = asyncio.run(run(args.address, load_prompts(args.prompts), args.concurrency, args.max_tokens))
    text = json.dumps(report, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
