"""Background responses (`background: true`) against the same responses run synchronously: one `tandem serve
--in-process` (real pair, bf16, AUTO; its embedded Redis holds the stored responses and the background events).

Per shipped prompt, 128 tokens greedy, three ways in an order rotated per prompt: synchronous streamed; background
streamed (the events read from the Redis stream as the runner writes them); background polled (GET every 0.2 s on one
kept-alive connection until it is finished). Each: seconds to the finished response, time to the first text
(streamed ways), the text. The background stream is also dropped after 12 events and read again after the 6th
(`starting_after`, as a client that lost the last 6 it was sent): the events once each, in order, and the time to the
first one read again (beside a plain GET's round trip meanwhile).
Then cancel: a 1024-token background response cancelled after 2 s (the cancel's round trip, the tokens it had), and a
16-token request right after it and again a second later, against the same request on the idle server, run twice
before (were the cancelled one still running, it would share the steps). Last, the event log's own cost: delta events
appended to a Redis stream of the bench's own (500 back to back, and 5 ms apart as a fast stream writes them): the
runner's wait per append, the Redis round trips they took, beside the in-memory log.

    PYTHONPATH=services python docs/bench/background-responses-v1.py docs/bench/background-responses-v1.json  # ~12 min
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
from tandem.gateway.openai.response_log import MemoryResponseLog, RedisResponseLog
from tandem.sessions import EmbeddedRedis
from tandem.sessions.embedded import free_port

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
MAX_TOKENS = 128
WAYS = ("sync_stream", "background_stream", "background_poll")
QUESTIONS = load_prompts()
TERMINAL = ("completed", "incomplete", "failed", "cancelled")
POLL_S = 0.2
RESUME_AFTER = 5  # a dropped stream is read again after its 6th event: the client lost the 6 after it


def body(question: str, **extra) -> dict:
    return {"input": question, "max_output_tokens": MAX_TOKENS, "temperature": 0} | extra


def text_of(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])


def each_event(lines):
    for line in lines:
        if line.startswith("data: "):
            yield json.loads(line[6:])


def events(lines, until: int | None = None) -> list[dict]:
    out = []
    for event in each_event(lines):
        out.append(event)
        if until is not None and len(out) == until:
            break
    return out


def streamed(url: str, payload: dict) -> dict:
    started, first, final = time.perf_counter(), None, None
    with httpx.stream("POST", f"{url}/v1/responses", json=payload, timeout=1800) as response:
        assert response.status_code == 200, response.read()
        for event in each_event(response.iter_lines()):  # as they come
            if first is None and event["type"] == "response.output_text.delta":
                first = time.perf_counter() - started
            final = event.get("response", final)
    assert final["status"] in TERMINAL, final["status"]
    return {"seconds": round(time.perf_counter() - started, 3), "ttft_s": round(first, 3), "text": text_of(final),
            "tokens": final["usage"]["output_tokens"], "id": final["id"]}


def polled(url: str, payload: dict) -> dict:
    started = time.perf_counter()
    with httpx.Client(timeout=60) as client:  # one connection, kept alive, as a polling client would
        response = client.post(f"{url}/v1/responses", json=payload).json()
        answered = time.perf_counter() - started
        while response["status"] not in TERMINAL:
            time.sleep(POLL_S)
            response = client.get(f"{url}/v1/responses/{response['id']}").json()
    return {"seconds": round(time.perf_counter() - started, 3), "answered_s": round(answered, 4),
            "text": text_of(response), "tokens": response["usage"]["output_tokens"], "id": response["id"]}


def run(url: str, way: str, question: str) -> dict:
    if way == "sync_stream":
        return streamed(url, body(question, stream=True, store=False))
    if way == "background_stream":
        return streamed(url, body(question, stream=True, background=True))
    return polled(url, body(question, background=True))


def resumed(url: str, question: str) -> dict:
    """A background stream dropped after 12 events, read again from the last one seen."""
    with httpx.stream("POST", f"{url}/v1/responses", json=body(question, stream=True, background=True),
                      timeout=1800) as response:
        head = events(response.iter_lines(), until=12)
    response_id = head[0]["response"]["id"]
    began = time.perf_counter()
    assert httpx.get(f"{url}/v1/responses/{response_id}", timeout=60).json()["status"] == "in_progress"
    plain_get = time.perf_counter() - began
    started = time.perf_counter()
    with httpx.stream("GET", f"{url}/v1/responses/{response_id}",
                      params={"stream": "true", "starting_after": head[RESUME_AFTER]["sequence_number"]},
                      timeout=1800) as response:
        lines = response.iter_lines()
        tail = events(lines, until=1)
        first_again = time.perf_counter() - started
        tail += events(lines)
    numbers = [event["sequence_number"] for event in head[:RESUME_AFTER + 1] + tail]
    return {"events": len(numbers), "every_event_once_in_order": numbers == list(range(len(numbers))),
            "last": tail[-1]["type"], "first_event_again_s": round(first_again, 4),
            "plain_get_while_running_s": round(plain_get, 4)}


def short(url: str) -> float:
    started = time.perf_counter()
    answer = httpx.post(f"{url}/v1/responses", json={"input": "Say hi.", "max_output_tokens": 16, "temperature": 0,
                                                     "ignore_eos": True, "store": False}, timeout=600)
    assert answer.status_code == 200
    return time.perf_counter() - started


def cancelled(url: str) -> dict:
    before = short(url)
    alone = short(url)
    started = httpx.post(f"{url}/v1/responses", json=body(QUESTIONS[0], background=True, max_output_tokens=1024,
                                                          ignore_eos=True), timeout=60).json()
    time.sleep(2.0)
    began = time.perf_counter()
    response = httpx.post(f"{url}/v1/responses/{started['id']}/cancel", timeout=60).json()
    cancel_s = time.perf_counter() - began
    after = short(url)
    time.sleep(1.0)
    later = short(url)
    return {"status": response["status"], "cancel_round_trip_s": round(cancel_s, 4),
            "text_chars_when_cancelled": len(text_of(response)), "short_alone_s": [round(before, 3), round(alone, 3)],
            "short_after_cancel_s": round(after, 3), "after_over_alone": round(after / alone, 3),
            "alone_second_over_first": round(alone / before, 3), "short_a_second_later_s": round(later, 3),
            "a_second_later_over_alone": round(later / alone, 3)}


def log_cost() -> dict:
    event = {"type": "response.output_text.delta", "sequence_number": 0, "item_id": "msg_" + "0" * 32,
             "output_index": 0, "content_index": 0, "delta": " hello", "logprobs": []}

    async def timed(log, gap_s: float) -> dict:
        """500 events appended `gap_s` apart (0: back to back), as a runner does: its wait per append, the wall
        time until the last is readable, and (Redis) the round trips they took."""
        times, began_all = [], time.perf_counter()
        for number in range(500):
            began = time.perf_counter()
            await log.append("bench", [event | {"sequence_number": number}])
            times.append(time.perf_counter() - began)
            await asyncio.sleep(gap_s)
        await log.end("bench")
        wall = time.perf_counter() - began_all
        assert len([e async for e in log.read("bench", -1)]) == 500
        await log.close()
        return {"append_us": round(statistics.median(times) * 1e6, 1), "wall_s": round(wall, 3),
                "round_trips": getattr(log, "round_trips", None)}

    out = {}
    for gap_s in (0.0, 0.005):
        with EmbeddedRedis() as redis:
            out[f"redis_gap_{gap_s}"] = asyncio.run(timed(RedisResponseLog(redis.url, 60), gap_s))
        out[f"memory_gap_{gap_s}"] = asyncio.run(timed(MemoryResponseLog(60), gap_s))
    return out


def mean(values) -> float:
    return round(statistics.mean(values), 3)


port = free_port()
flags = ["--target", TARGET, "--draft", DRAFT, "--in-process", "--dtype", "bfloat16", "--threads", "2"]
rows = []
with tempfile.TemporaryDirectory() as scratch, serve_process(flags, Path(scratch) / "serve.log", timeout_s=1800,
                                                             http_port=port):
    url = f"http://127.0.0.1:{port}"
    streamed(url, body("Say hello.", stream=True, store=False))  # warm-up
    for index, question in enumerate(QUESTIONS):
        order = WAYS[index % 3:] + WAYS[:index % 3]
        row = {"order": list(order)} | {way: run(url, way, question) for way in order}
        rows.append(row)
        print(json.dumps({way: (row[way]["seconds"], row[way]["tokens"]) for way in WAYS}), flush=True)
        Path(sys.argv[1]).write_text(json.dumps({"rows": rows}, indent=1) + "\n")  # so far
    resumes = [resumed(url, question) for question in QUESTIONS[:4]]
    cancels = [cancelled(url) for _ in range(3)]
cost = log_cost()

summary = {way: {"seconds": mean(row[way]["seconds"] for row in rows),
                 "tokens": mean(row[way]["tokens"] for row in rows)} for way in WAYS}
for way in ("sync_stream", "background_stream"):
    summary[way]["ttft_s"] = mean(row[way]["ttft_s"] for row in rows)
summary["background_poll"]["answered_s"] = mean(row["background_poll"]["answered_s"] for row in rows)
for way in WAYS[1:]:
    summary[f"{way}_over_sync_seconds"] = round(summary[way]["seconds"] / summary["sync_stream"]["seconds"], 3)
    summary[f"{way}_same_text_as_sync"] = f"{sum(row[way]['text'] == row['sync_stream']['text'] for row in rows)}/" \
                                          f"{len(rows)}"
summary["resumed_every_event_once"] = f"{sum(r['every_event_once_in_order'] for r in resumes)}/{len(resumes)}"
summary["resumed_first_event_again_s"] = mean(r["first_event_again_s"] for r in resumes)
summary["cancel_round_trip_s"] = mean(c["cancel_round_trip_s"] for c in cancels)
summary["short_after_cancel_over_alone"] = mean(c["after_over_alone"] for c in cancels)
summary["short_alone_second_over_first"] = mean(c["alone_second_over_first"] for c in cancels)
summary["short_a_second_after_cancel_over_alone"] = mean(c["a_second_later_over_alone"] for c in cancels)
summary["plain_get_while_running_s"] = mean(r["plain_get_while_running_s"] for r in resumes)
summary["log"] = cost
Path(sys.argv[1]).write_text(json.dumps({"rows": rows, "resumes": resumes, "cancels": cancels, "summary": summary},
                                        indent=1) + "\n")
print(json.dumps(summary))
