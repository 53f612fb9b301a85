"""A conversation kept by the server as a Conversations API conversation (`conversation`) against the same one chained
by previous_response_id: one `tandem serve --in-process` (real pair, bf16, AUTO, its embedded Redis holding both).

Per shipped prompt, 3 turns (the question, then two follow-ups), streamed, greedy, 48 tokens a turn, both ways one
after the other, which first alternating prompt by prompt: each turn's time to first text, seconds, input tokens,
and whether both ways wrote the same text; at the end, each conversation's items against its turns (in order, each
turn's input then output). Then the store's own cost, against a Redis of the bench's own: a conversation of the
largest size extended by one turn (ConversationStore.extend, median of 50).

    PYTHONPATH=services python docs/bench/conversations-v1.py docs/bench/conversations-v1.json   # ~12 min on CPU-A
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
from tandem.gateway.openai.conversations import ConversationStore
from tandem.sessions import EmbeddedRedis, open_session_store
from tandem.sessions.embedded import free_port

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
FOLLOW_UPS = ["Now add type hints and a docstring.", "Write two pytest tests for it."]
MAX_TOKENS = 48
QUESTIONS = load_prompts()


def respond(client: httpx.Client, body: dict) -> dict:
    body = {"max_output_tokens": MAX_TOKENS, "temperature": 0, "stream": True} | body
    started, first, final = time.perf_counter(), None, None
    with client.stream("POST", "/v1/responses", json=body) as response:
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
    return {"ttft_s": round(first or 0.0, 3), "seconds": round(time.perf_counter() - started, 3), "id": final["id"],
            "text": "".join(part["text"] for item in final["output"] if item["type"] == "message"
                            for part in item["content"]),
            "input_tokens": final["usage"]["input_tokens"]}


def turns(client: httpx.Client, question: str, way: str) -> dict:
    out, previous = [], None
    conversation = client.post("/v1/conversations", json={}).json()["id"] if way == "conversation" else None
    for text in [question, *FOLLOW_UPS]:
        if way == "conversation":
            turn = respond(client, {"input": text, "conversation": conversation})
        else:
            turn = respond(client, {"input": text} | ({"previous_response_id": previous} if previous else {}))
            previous = turn["id"]
        out.append(turn)
    row = {"turns": out}
    if conversation is not None:
        items = client.get(f"/v1/conversations/{conversation}/items", params={"order": "asc", "limit": 100}).json()
        texts = [part["text"] for item in items["data"] for part in item["content"]]
        row["items_in_order"] = texts == [t for text, turn in zip([question, *FOLLOW_UPS], out, strict=True)
                                          for t in (text, turn["text"])]
        row["conversation"] = conversation
    return row


def extend_cost(client: httpx.Client, conversation: str) -> dict:
    items = client.get(f"/v1/conversations/{conversation}/items", params={"order": "asc", "limit": 100}).json()
    turn = items["data"][-2:]

    async def timed() -> dict:
        with EmbeddedRedis() as redis:
            store = ConversationStore(open_session_store(redis.url))
            created = await store.create("bench", items["data"][:-2], {})
            times = []
            for _ in range(50):
                began = time.perf_counter()
                await store.extend("bench", created["id"], turn)
                times.append(time.perf_counter() - began)
                await store.update("bench", created["id"], lambda record: record.update(items=record["items"][:-2]))
            store.close()
        return {"items": len(items["data"]), "record_bytes": len(json.dumps(items["data"])),
                "extend_ms": round(statistics.median(times) * 1000, 2)}

    return asyncio.run(timed())


def mean(values) -> float:
    return round(statistics.mean(values), 3)


port = free_port()
flags = ["--target", TARGET, "--draft", DRAFT, "--in-process", "--dtype", "bfloat16", "--threads", "2"]
rows = []
with tempfile.TemporaryDirectory() as scratch, serve_process(flags, Path(scratch) / "serve.log", timeout_s=1800,
                                                             http_port=port), \
        httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=1800) as client:
    respond(client, {"input": "Say hello.", "store": False})  # warm-up
    for index, question in enumerate(QUESTIONS):
        order = ("conversation", "chained") if index % 2 == 0 else ("chained", "conversation")
        row = {way: turns(client, question, way) for way in order}
        rows.append(row)
        print(json.dumps({way: [(t["ttft_s"], t["input_tokens"]) for t in row[way]["turns"]] for way in order}),
              flush=True)
        Path(sys.argv[1]).write_text(json.dumps({"rows": rows}, indent=1) + "\n")  # so far
    cost = extend_cost(client, rows[-1]["conversation"]["conversation"])

summary = {"store": cost,
           "items_in_order": f"{sum(row['conversation']['items_in_order'] for row in rows)}/{len(rows)}"}
for turn in range(1 + len(FOLLOW_UPS)):
    for way in ("conversation", "chained"):
        summary[f"turn{turn + 1}_{way}"] = {key: mean(row[way]["turns"][turn][key] for row in rows)
                                           for key in ("ttft_s", "seconds", "input_tokens")}
    for key in ("input_tokens", "text"):
        same = sum(row["conversation"]["turns"][turn][key] == row["chained"]["turns"][turn][key] for row in rows)
        summary[f"turn{turn + 1}_same_{key}"] = f"{same}/{len(rows)}"
later = range(1, 1 + len(FOLLOW_UPS))
summary["later_turns_ttft_conversation_over_chained"] = round(
    mean(row["conversation"]["turns"][t]["ttft_s"] for row in rows for t in later)
    / mean(row["chained"]["turns"][t]["ttft_s"] for row in rows for t in later), 3)
Path(sys.argv[1]).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1) + "\n")
print(json.dumps(summary))
