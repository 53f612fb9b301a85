"""What `tandem generate` prints once its text has streamed, the same whether it ran here or on a gateway
(`--address`): a summary line, and the JSON object `--json` asks for.

Imports only the standard library and cli.options: the remote run needs only the client install.
"""

from __future__ import annotations

import sys

from tandem.cli.options import STDOUT, write_json


def print_outcome(json_target: str | None, text: str | None, token_ids: list[int], finish_reason: str,
                  prompt_tokens: int, elapsed: float, first_token_at: float | None, speculative: bool, stats: dict,
                  **extra) -> None:
    """The end of `tandem generate`, local or remote: a summary line after the streamed text, and the JSON object
    where `--json` asked for it (stdout instead of the text, or a file)."""
    if json_target != STDOUT:
        sys.stdout.write("\n")
        # An acceptance rate only where something was drafted (0.00 read as every draft rejected).
        drafted = stats["drafted"]
        acceptance = f", acceptance {stats['acceptance_rate']:.2f}" if speculative and drafted else ""
        print(f"[{len(token_ids)} tokens, {elapsed:.2f}s, finish: {finish_reason}{acceptance}]", file=sys.stderr)
    write_json(json_target, {
        "text": text,
        "token_ids": token_ids,
        "finish_reason": finish_reason,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(token_ids),
        "seconds": round(elapsed, 4),
        "time_to_first_token": round(first_token_at if first_token_at is not None else elapsed, 4),
        "tokens_per_second": round(len(token_ids) / elapsed, 3) if elapsed > 0 else None,
        "speculative": speculative,
        "stats": stats,
        **extra,
    })
