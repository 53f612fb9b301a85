"""An OpenAI-style streamed request for benchmark scripts: each server-sent chunk with the seconds since the request
was sent, and the usage and text those chunks carry."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import httpx


def streamed(url: str, body: dict, text_of: Callable[[dict], str], first_needs_text: bool = False) -> dict:
    """POST `body` to `url` (streamed, usage included by the caller's `stream_options`) and read it whole: time to
    the first choice (with `first_needs_text`, the first whose `text_of` is not empty), seconds, the text, and the
    prompt, cached prompt and completion tokens its usage reports."""
    started, first, text, usage = time.perf_counter(), None, [], {}
    with httpx.stream("POST", url, json=body, timeout=1800) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                piece = text_of(choice)
                if first is None and (piece or not first_needs_text):
                    first = time.perf_counter() - started
                text.append(piece)
    return {"ttft_s": round(first or 0.0, 3), "seconds": round(time.perf_counter() - started, 3),
            "text": "".join(text), "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            "completion_tokens": usage.get("completion_tokens")}
