"""Multi-turn benchmark: a chat's follow-up turn with its session's cached prefix reused, against a fresh session.

    python -m tandem.bench.turns --address 127.0.0.1:50051 --max-tokens 64 --json turns.json

For each prompt: turn 1 in session S; then the follow-up (turn 1's question and answer plus a new question) once in
S, whose workers kept turn 1's KV cache and so prefill only what is new, and once in a new session, which prefills
the whole conversation. Which of the two runs first alternates from prompt to prompt. Reports time to first token
and tok/s of the follow-ups.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid

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

FOLLOW_UP = "Now add type hints and a docstring, and explain the complexity."


async def _turn(client: AsyncTandemClient, messages: list[dict], max_tokens: int, session: str) -> dict:
    started = time.perf_counter()
    first, text, tokens = None, [], 0
    async for item in client.generate(chat=messages, temperature=0.0, max_tokens=max_tokens, session_id=session):
        if hasattr(item, "text"):
            first = first or time.perf_counter()
            text.append(item.text)
            tokens += len(item.token_ids)
    seconds = time.perf_counter() - started
    return {"ttft": (first or time.perf_counter()) - started, "seconds": seconds, "tokens": tokens,
            "text": "".join(text)}


async def run(address: str, prompts: list[str], max_tokens: int) -> dict:
    rows = []
    async with AsyncTandemClient(address, timeout=1800) as client:
        await _turn(client, [{"role": "user", "content": "hi"}], 4, f"warmup-{uuid.uuid4().hex}")
        for i, prompt in enumerate(prompts):
            session = f"turns-{uuid.uuid4().hex}"
            first = await _turn(client, [{"role": "user", "content": prompt}], max_tokens, session)
            conversation = [{"role": "user", "content": prompt}, {"role": "assistant", "content": first["text"]},
                            {"role": "user", "content": FOLLOW_UP}]
            order = ["reused", "fresh"] if i % 2 == 0 else ["fresh", "reused"]
            row, texts = {}, {}
            for kind in order:
                turn_session = session if kind == "reused" else f"fresh-{uuid.uuid4().hex}"
                result = await _turn(client, conversation, max_tokens, turn_session)
                texts[kind] = result.pop("text")
                row[kind] = {k: round(v, 4) for k, v in result.items()}
            row["same_output"] = texts["reused"] == texts["fresh"]
            rows.append(row)

    def mean(kind: str, key: str) -> float:
        return sum(r[kind][key] for r in rows) / len(rows)

    report = {"address": address, "max_tokens": max_tokens, "prompts": len(rows), "follow_ups": rows,
              "same_output": sum(r["same_output"] for r in rows)}
    for kind in ("reused", "fresh"):
        tokens = sum(r[kind]["tokens"] for r in rows)
        report[kind] = {"mean_ttft_s": round(mean(kind, "ttft"), 4),
                        "tok_s": round(tokens / sum(r[kind]["seconds"] for r in rows), 3)}
    report["ttft_fresh_over_reused"] = round(report["fresh"]["mean_ttft_s"] / report["reused"]["mean_ttft_s"], 3)
    return report


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse bad values before any request (a negative --num-prompts sliced the list from its end): one line naming
    the flag, exit status 2, as the tandem CLI does."""
    refuse_bad_values(parser, at_least(args, max_tokens=1, num_prompts=1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--address", default=DEFAULT_ADDRESS, help="the server's HOST:PORT")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per turn")
    add_prompts_option(parser, PROMPT_SETS, DEFAULT_PROMPTS)
    parser.add_argument("--num-prompts", type=int, default=4, help="use only the first N prompts")
    add_json_option(parser, "the report")
    args = parser.parse_args(argv)
    _check_args(parser, args)
    report = asyncio.run(run(args.address, load_prompts(args.prompts)[: args.num_prompts], args.max_tokens))
    if wants_text(args):
        print(json.dumps(report, indent=2))
    write_json(args.json, report)


if __name__ == "__main__":
    main()
