"""A conversation over the Responses API continued from its stored response (previous_response_id) against the same
conversation sent whole each turn (store false): one `tandem serve --in-process` (real pair, bf16, AUTO, its embedded
Redis holding the stored responses), both ways alternated per prompt (stored first on even prompts, whole first on
odd; the other way round with `whole-first`), so each way follows the other as often.

Per shipped prompt, 3 turns (the question, then two follow-ups), streamed, greedy, 48 tokens a turn: each turn's
request body bytes, time to first text, seconds, input tokens and cached input tokens, and whether both ways wrote the
same text. Then the store's own cost, against a Redis of the bench's own: writing and reading back the largest stored
conversation (ResponseStore.put / get, median of 50).

    PYTHONPATH=services python docs/bench/stored-responses-v1.py docs/bench/stored-responses-v1.json   # ~12 min
    PYTHONPATH=services python docs/bench/stored-responses-v1.py docs/bench/stored-responses-v1b.json whole-first
"""
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tandem.bench.local_cluster import serve_process
from tandem.bench.prompts import load_prompts
from tandem.gateway.openai.stored import ResponseStore, StoredResponse
from tandem.sessions import EmbeddedRedis, open_session_store
from tandem.sessions.embedded import free_port

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
FOLLOW_UPS = ["Now add type hints and a docstring.", "Write two pytest tests for it."]
MAX_TOKENS = 48
QUESTIONS = load_prompts()
STORED_FIRST_ON = 1 if sys.argv[2:] == ["whole-first"] else 0  # the prompts' parity on which the stored way runs first


def respond(url: str, body: dict) -> dict:
    """One streamed response: body bytes, time to the first text delta, seconds, the final response."""
    body = {"max_output_tokens": MAX_TOKENS, "temperature": 0, "stream": True} | body
    sent = json.dumps(body).encode()
    started, first, final = time.perf_counter(), None, None
    with httpx.stream("POST", f"{url}/v1/responses", content=sent, timeout=1800,
                      headers={"content-type": "application/json"}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if first is None and event["type"] == "response.output_text.delta" and event["delta"]:
                first = time.perf_counter() - started
            if event["type"] in ("response.completed", "response.incomplete"):
                final = event["response"]
    assert final is not None
    usage = final["usage"]
    return {"body_bytes": len(sent), "ttft_s": round(first or 0.0, 3),
            "seconds": round(time.perf_counter() - started, 3), "id": final["id"],
            "text": "".join(part["text"] for item in final["output"] if item["type"] == "message"
                            for part in item["content"]),
            "input_tokens": usage["input_tokens"], "cached_tokens": usage["input_tokens_details"]["cached_tokens"]}


def user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def conversation(url: str, question: str, stored: bool) -> list[dict]:
    turns, items, previous = [], [], None
    for text in [question, *FOLLOW_UPS]:
        if stored:
            turn = respond(url, {"input": [user(text)]} | ({"previous_response_id": previous} if previous else {}))
            previous = turn["id"]
        else:
            items.append(user(text))
            turn = respond(url, {"input": items, "store": False})
            items.append({"type": "message", "role": "assistant",
                          "content": [{"type": "output_text", "text": turn["text"]}]})
        turns.append(turn)
    return turns


def store_cost(url: str, response_id: str) -> dict:
    """Writing and reading back the record of `response_id` (fetched from the server) in a Redis of our own."""
    response = httpx.get(f"{url}/v1/responses/{response_id}", timeout=60).json()
    items = httpx.get(f"{url}/v1/responses/{response_id}/input_items", params={"order": "asc", "limit": 100},
                      timeout=60).json()["data"]
    record = StoredResponse(response, items)

    async def timed() -> dict:
        with EmbeddedRedis() as redis:
            store = ResponseStore(open_session_store(redis.url))
            puts, gets = [], []
            for _ in range(50):
                began = time.perf_counter()
                await store.put("bench", record)
                puts.append(time.perf_counter() - began)
                began = time.perf_counter()
                assert await store.get("bench", response_id) == record
                gets.append(time.perf_counter() - began)
            store.close()
        return {"record_bytes": len(json.dumps({"response": response, "items": items})), "items": len(items),
                "put_ms": round(statistics.median(puts) * 1000, 2), "get_ms": round(statistics.median(gets) * 1000, 2)}

    return asyncio.run(timed())


def mean(values) -> float:
    return round(statistics.mean(values), 3)


port = free_port()
flags = ["--target", TARGET, "--draft", DRAFT, "--in-process", "--dtype", "bfloat16", "--threads", "2"]
rows = []
with tempfile.TemporaryDirectory() as scratch, serve_process(flags, Path(scratch) / "serve.log", timeout_s=1800,
                                                             http_port=port):
    url = f"http://127.0.0.1:{port}"
    respond(url, {"input": "Say hello.", "store": False})  # warm-up
    for index, question in enumerate(QUESTIONS):
        order = (True, False) if index % 2 == STORED_FIRST_ON else (False, True)
        ways = {("stored" if stored else "whole"): conversation(url, question, stored) for stored in order}
        rows.append(ways)
        print(json.dumps({way: [(t["body_bytes"], t["ttft_s"], t["cached_tokens"]) for t in turns]
                          for way, turns in ways.items()}), flush=True)
        Path(sys.argv[1]).write_text(json.dumps({"rows": rows}, indent=1) + "\n")  # so far
    cost = store_cost(url, rows[-1]["stored"][-1]["id"])

summary = {"store": cost}
for turn in range(1 + len(FOLLOW_UPS)):
    for way in ("stored", "whole"):
        turns = [row[way][turn] for row in rows]
        summary[f"turn{turn + 1}_{way}"] = {key: mean(t[key] for t in turns)
                                           for key in ("body_bytes", "ttft_s", "seconds", "input_tokens",
                                                       "cached_tokens")}
    same = sum(row["stored"][turn]["text"] == row["whole"][turn]["text"] for row in rows)
    summary[f"turn{turn + 1}_same_text"] = f"{same}/{len(rows)}"
last = len(FOLLOW_UPS) + 1
summary["last_turn_body_whole_over_stored"] = round(summary[f"turn{last}_whole"]["body_bytes"]
                                                    / summary[f"turn{last}_stored"]["body_bytes"], 2)
summary["later_turns_ttft_stored_over_whole"] = round(
    mean(row["stored"][t]["ttft_s"] for row in rows for t in range(1, last))
    / mean(row["whole"][t]["ttft_s"] for row in rows for t in range(1, last)), 3)
# Each way ran first on half the prompts: the one running second finds more of the conversation cached (the first
# way's turns were the same tokens where the texts agree), so later turns are also compared by position.
for way, first_on in (("stored", STORED_FIRST_ON), ("whole", 1 - STORED_FIRST_ON)):
    for position, parity in (("first", first_on), ("second", 1 - first_on)):
        summary[f"later_turns_ttft_{way}_run_{position}"] = mean(
            row[way][t]["ttft_s"] for index, row in enumerate(rows) if index % 2 == parity for t in range(1, last))
Path(sys.argv[1]).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1) + "\n")
print(json.dumps(summary))
