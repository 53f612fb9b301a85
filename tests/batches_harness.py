"""What the Batch API tests share: a chat request line, uploading a file of lines, waiting for a batch to end, and
a result file's lines by custom_id."""

from __future__ import annotations

import json
import time

import openai

from gateway_harness import polled

MODEL = "tiny-target"
GREEDY = {"temperature": 0, "ignore_eos": True}
ENDED = ("completed", "failed", "expired", "cancelled")


def _chat(custom_id: str, text: str, max_tokens: int = 4, **extra) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                     **GREEDY, **extra}}


def _upload(sdk: openai.OpenAI, lines: list[dict | str]) -> str:
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    return sdk.files.create(file=("requests.jsonl", text.encode()), purpose="batch").id


def _ended(sdk: openai.OpenAI, batch_id: str, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while (batch := polled(lambda: sdk.batches.retrieve(batch_id))).status not in ENDED:
        assert time.monotonic() < deadline, f"{batch_id} still {batch.status}"
        time.sleep(0.05)
    return batch


def _lines(sdk: openai.OpenAI, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    return {line["custom_id"]: line for line in map(json.loads, sdk.files.content(file_id).text.splitlines())}
