"""The Batch API against a client sending the same requests itself: one `tandem serve --in-process` (real pair, bf16,
AUTO; its embedded Redis holds the files and batches).

The 8 shipped prompts as chat completions (128 tokens, greedy, ignore_eos, so every way does the same work), two ways
in an order alternated per round, 4 rounds: a batch (upload the JSONL file, create the batch, poll it every 0.5 s,
download its output file; the gateway runs up to 8 of its requests at once) and a client sending the 8 requests at once
itself (8 threads). Each: wall seconds, and per prompt the text, compared across the ways. Then the cost of a large
file: 10,000 one-token requests uploaded (seconds, bytes), the batch created (seconds: the file read and validated),
and cancelled at once (seconds until cancelled). Last, a restart: a batch of the 8 prompts three times, the server
stopped (SIGTERM: it drains, then lets the batch go) once 8 are answered, and a second server over the same Redis
started: the batch's counts when the first stopped, the seconds from the second's readiness to the batch completed,
the requests the second answered, every request in the output once, and its texts against the client's.

    PYTHONPATH=services python docs/bench/batches-v1.py docs/bench/batches-v1.json   # ~12 min on CPU-A
"""
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tandem.bench.local_cluster import serve_process
from tandem.bench.prompts import load_prompts
from tandem.sessions import EmbeddedRedis
from tandem.sessions.embedded import free_port

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
MAX_TOKENS = 128
ROUNDS = 4
COPIES = 3  # the restart's batch: the prompts this many times
QUESTIONS = load_prompts()
ENDED = ("completed", "failed", "expired", "cancelled")


def chat(question: str, max_tokens: int = MAX_TOKENS) -> dict:
    return {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}


def upload(client: httpx.Client, lines: list[dict]) -> tuple[str, int]:
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    answer = client.post("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", content)})
    assert answer.status_code == 200, answer.text
    return answer.json()["id"], len(content)


def wait_ended(client: httpx.Client, batch_id: str, poll_s: float) -> dict:
    while (batch := client.get(f"/v1/batches/{batch_id}").json())["status"] not in ENDED:
        time.sleep(poll_s)
    return batch


def as_batch(client: httpx.Client) -> dict:
    started = time.perf_counter()
    lines = [{"custom_id": str(n), "method": "POST", "url": "/v1/chat/completions", "body": chat(question)}
             for n, question in enumerate(QUESTIONS)]
    file_id, _ = upload(client, lines)
    created = client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                               "completion_window": "24h"}).json()
    batch = wait_ended(client, created["id"], 0.5)
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == len(QUESTIONS), batch
    output = client.get(f"/v1/files/{batch['output_file_id']}/content").text
    texts = {}
    for line in map(json.loads, output.splitlines()):
        texts[int(line["custom_id"])] = line["response"]["body"]["choices"][0]["message"]["content"]
    return {"seconds": round(time.perf_counter() - started, 3), "texts": [texts[n] for n in range(len(QUESTIONS))]}


def as_client(url: str) -> dict:
    started = time.perf_counter()

    def one(question: str) -> str:
        answer = httpx.post(f"{url}/v1/chat/completions", json=chat(question), timeout=1800)
        assert answer.status_code == 200, answer.text
        return answer.json()["choices"][0]["message"]["content"]

    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        texts = list(pool.map(one, QUESTIONS))
    return {"seconds": round(time.perf_counter() - started, 3), "texts": texts}


def large_file(client: httpx.Client) -> dict:
    lines = [{"custom_id": f"n{n}", "method": "POST", "url": "/v1/chat/completions", "body": chat(f"Say {n}.", 1)}
             for n in range(10_000)]
    began = time.perf_counter()
    file_id, size = upload(client, lines)
    uploaded = time.perf_counter() - began
    began = time.perf_counter()
    created = client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                               "completion_window": "24h"}).json()
    create_s = time.perf_counter() - began
    began = time.perf_counter()
    client.post(f"/v1/batches/{created['id']}/cancel")
    batch = wait_ended(client, created["id"], 0.05)
    return {"requests": len(lines), "bytes": size, "upload_s": round(uploaded, 3), "create_s": round(create_s, 3),
            "cancelled_in_s": round(time.perf_counter() - began, 3), "status": batch["status"],
            "finished_before_cancel": batch["request_counts"]["completed"]}


def restart(client: httpx.Client) -> dict:
    """A batch of the 8 prompts three times (24 requests) created, and the server stopped (SIGTERM) once 8 are
    answered: the 8 in flight then finish in its drain, the last 8 are left to the next server."""
    lines = [{"custom_id": f"{copy}-{n}", "method": "POST", "url": "/v1/chat/completions", "body": chat(question)}
             for copy in range(COPIES) for n, question in enumerate(QUESTIONS)]
    file_id, _ = upload(client, lines)
    created = client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                               "completion_window": "24h"}).json()
    while (batch := client.get(f"/v1/batches/{created['id']}").json())["request_counts"]["completed"] < 8:
        time.sleep(0.1)
    return batch


def resumed(client: httpx.Client, batch_id: str, texts: list[str]) -> dict:
    began, began_at = time.perf_counter(), int(time.time())
    kept = client.get(f"/v1/batches/{batch_id}").json()
    batch = wait_ended(client, batch_id, 0.5)
    seconds = time.perf_counter() - began
    output = [json.loads(line) for line in client.get(f"/v1/files/{batch['output_file_id']}/content").text.splitlines()]
    ids = sorted(line["custom_id"] for line in output)
    same = sum(line["response"]["body"]["choices"][0]["message"]["content"] == texts[int(line["custom_id"][2:])]
               for line in output)
    created = [line["response"]["body"]["created"] for line in output]
    return {"status": batch["status"], "kept_at_restart": kept["request_counts"], "final": batch["request_counts"],
            "every_request_once": ids == sorted(f"{c}-{n}" for c in range(COPIES) for n in range(len(QUESTIONS))),
            "answered_by_the_second_server": sum(stamp >= began_at for stamp in created),
            "seconds_after_second_server_ready": round(seconds, 3),
            "same_text_as_client": f"{same}/{len(output)}"}


flags = ["--target", TARGET, "--draft", DRAFT, "--in-process", "--dtype", "bfloat16", "--threads", "2"]
rounds = []
with tempfile.TemporaryDirectory() as scratch, EmbeddedRedis() as redis:
    flags += ["--redis-url", redis.url]
    port = free_port()
    with serve_process(flags, Path(scratch) / "serve.log", timeout_s=1800, http_port=port):
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url, timeout=600) as client:
            as_client(url)  # warm-up
            for index in range(ROUNDS):
                order = ("batch", "client") if index % 2 == 0 else ("client", "batch")
                row = {"order": list(order)}
                for way in order:
                    row[way] = as_batch(client) if way == "batch" else as_client(url)
                rounds.append(row)
                print(json.dumps({way: row[way]["seconds"] for way in order}), flush=True)
            large = large_file(client)
            stopped = restart(client)
        stop_began = time.perf_counter()
    stop_s = time.perf_counter() - stop_began
    port = free_port()
    with (serve_process(flags, Path(scratch) / "serve-2.log", timeout_s=1800, http_port=port) as (_, ready_s),
          httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client):
        again = resumed(client, stopped["id"], rounds[0]["client"]["texts"])
    again |= {"completed_when_stopped": stopped["request_counts"]["completed"], "stop_s": round(stop_s, 3),
              "second_server_ready_s": ready_s}
    print(json.dumps(again), flush=True)

summary = {way: round(statistics.mean(row[way]["seconds"] for row in rounds), 3) for way in ("batch", "client")}
summary["batch_over_client_seconds"] = [round(row["batch"]["seconds"] / row["client"]["seconds"], 3)
                                        for row in rounds]
same = sum(a == b for row in rounds for a, b in zip(row["batch"]["texts"], row["client"]["texts"], strict=True))
summary["same_text_batch_and_client"] = f"{same}/{len(rounds) * len(QUESTIONS)}"
summary["large_file"] = large
summary["restart"] = again
result = {"setup": {"target": TARGET, "draft": DRAFT, "dtype": "bfloat16", "threads": 2, "max_tokens": MAX_TOKENS,
                    "prompts": len(QUESTIONS)}, "summary": summary, "rounds": rounds}
print(json.dumps(summary, indent=1))
Path(sys.argv[1]).write_text(json.dumps(result, indent=1) + "\n")
