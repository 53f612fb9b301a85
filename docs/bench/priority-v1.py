"""An interactive request while background work fills the batch: first-token and whole latency by how the background
is sent. One `tandem serve --in-process` (real pair, bf16, AUTO, --max-batch 4; its embedded Redis holds the Batch
API's files and batches).

Background: the 8 shipped prompts as chat completions (128 tokens, greedy, ignore_eos), sent at once in one of three
ways, in an order rotated per round: `fcfs` (8 client streams of the default priority 0: the interactive request, sent
9th, waits for a place in arrival order), `priority` (the same 8 with `priority` 1) and `batch` (the Batch API, 8
lines; the gateway runs up to 8 at once, behind every client's request). INTERACTIVE_AFTER_S after the background is
sent, one interactive request (64 tokens, greedy, streamed) goes in: its first-token seconds, whole seconds and
tokens/s after the first; then the background's wall seconds (until both it and the interactive request ended) and,
for client streams, when each background request ended. Each round also times the interactive request alone
(`idle`), the floor. 3 rounds.

    PYTHONPATH=services python docs/bench/priority-v1.py docs/bench/priority-v1.json   # ~12 min on CPU-A
"""
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from tandem.bench.local_cluster import serve_process
from tandem.bench.prompts import load_prompts
from tandem.bench.sse import streamed
from tandem.sessions import EmbeddedRedis
from tandem.sessions.embedded import free_port

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
MAX_BATCH, BACKGROUND_TOKENS, INTERACTIVE_TOKENS = 4, 128, 64
INTERACTIVE_AFTER_S = 6.0  # the background's first 4 prompts are prefilled and decoding by then
ROUNDS = 3
QUESTIONS = load_prompts()
INTERACTIVE = "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring."
ENDED = ("completed", "failed", "expired", "cancelled")


def chat(question: str, max_tokens: int, **extra) -> dict:
    return {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}


def interactive(url: str) -> dict:
    body = chat(INTERACTIVE, INTERACTIVE_TOKENS, stream=True, stream_options={"include_usage": True})
    got = streamed(f"{url}/v1/chat/completions", body, lambda choice: choice["delta"].get("content") or "",
                   first_needs_text=True)
    first, whole, tokens = got["ttft_s"], got["seconds"], got["completion_tokens"]
    return {"first_token_s": first, "whole_s": whole, "tokens": tokens,
            "tokens_per_s_after_first": round((tokens - 1) / (whole - first), 2)}


def client_background(url: str, priority: int, ends: list[float]) -> threading.Thread:
    began = time.perf_counter()

    def one(question: str) -> None:
        answer = httpx.post(f"{url}/v1/chat/completions", json=chat(question, BACKGROUND_TOKENS, priority=priority),
                            timeout=1800)
        assert answer.status_code == 200, answer.text
        ends.append(round(time.perf_counter() - began, 2))

    threads = [threading.Thread(target=one, args=(question,)) for question in QUESTIONS]
    for thread in threads:
        thread.start()

    def join() -> None:
        for thread in threads:
            thread.join()

    joiner = threading.Thread(target=join)
    joiner.start()
    return joiner


def batch_background(client: httpx.Client) -> threading.Thread:
    lines = [{"custom_id": str(n), "method": "POST", "url": "/v1/chat/completions",
              "body": chat(question, BACKGROUND_TOKENS)} for n, question in enumerate(QUESTIONS)]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    file_id = client.post("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", content)}).json()["id"]
    batch_id = client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                                "completion_window": "24h"}).json()["id"]

    def wait() -> None:
        while (batch := client.get(f"/v1/batches/{batch_id}").json())["status"] not in ENDED:
            time.sleep(0.2)
        assert batch["status"] == "completed" and batch["request_counts"]["completed"] == len(QUESTIONS), batch

    waiter = threading.Thread(target=wait)
    waiter.start()
    return waiter


def under_background(way: str, url: str, client: httpx.Client) -> dict:
    began = time.perf_counter()
    ends: list[float] = []  # each background client request's end, seconds from the start
    if way == "batch":
        background = batch_background(client)
    else:
        background = client_background(url, 1 if way == "priority" else 0, ends)
    time.sleep(INTERACTIVE_AFTER_S)
    row = interactive(url)
    row["interactive_end_s"] = round(time.perf_counter() - began, 2)
    background.join()
    return row | {"background_s": round(time.perf_counter() - began, 3), "background_ends_s": sorted(ends)}


WAYS = ("fcfs", "priority", "batch")
flags = ["--target", TARGET, "--draft", DRAFT, "--in-process", "--dtype", "bfloat16", "--threads", "2",
         "--max-batch", str(MAX_BATCH), "--batch-concurrency", "8"]
rounds = []
with tempfile.TemporaryDirectory() as scratch, EmbeddedRedis() as redis:
    port = free_port()
    with serve_process(flags + ["--redis-url", redis.url], Path(scratch) / "serve.log", timeout_s=1800,
                       http_port=port):
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url, timeout=1800) as client:
            interactive(url)  # warm-up
            under_background("priority", url, client)
            for index in range(ROUNDS):
                order = WAYS[index:] + WAYS[:index]
                row = {"order": list(order), "idle": interactive(url)}
                for way in order:
                    row[way] = under_background(way, url, client)
                rounds.append(row)
                print(json.dumps({way: row[way] for way in ("idle", *order)}), flush=True)


def mean(way: str, key: str) -> float:
    return round(statistics.mean(row[way][key] for row in rounds), 3)


summary = {way: {key: mean(way, key) for key in ("first_token_s", "whole_s", "tokens_per_s_after_first")}
           for way in ("idle", *WAYS)}
for way in WAYS:
    summary[way]["background_s"] = mean(way, "background_s")
summary["first_token_fcfs_over_priority"] = [round(row["fcfs"]["first_token_s"] / row["priority"]["first_token_s"],
                                                   2) for row in rounds]
summary["whole_fcfs_over_priority"] = [round(row["fcfs"]["whole_s"] / row["priority"]["whole_s"], 2)
                                       for row in rounds]
summary["whole_batch_over_priority"] = [round(row["batch"]["whole_s"] / row["priority"]["whole_s"], 2)
                                        for row in rounds]
summary["whole_priority_over_idle"] = [round(row["priority"]["whole_s"] / row["idle"]["whole_s"], 2)
                                       for row in rounds]
summary["background_priority_over_fcfs"] = [round(row["priority"]["background_s"] / row["fcfs"]["background_s"], 3)
                                            for row in rounds]
result = {"setup": {"target": TARGET, "draft": DRAFT, "dtype": "bfloat16", "threads": 2, "max_batch": MAX_BATCH,
                    "background_requests": len(QUESTIONS), "background_tokens": BACKGROUND_TOKENS,
                    "interactive_tokens": INTERACTIVE_TOKENS, "interactive_after_s": INTERACTIVE_AFTER_S},
          "summary": summary, "rounds": rounds}
print(json.dumps(summary, indent=1))
Path(sys.argv[1]).write_text(json.dumps(result, indent=1) + "\n")
