"""`truncation: "auto"` on the real pair: an agent's conversation grown past the server's prompt limit, sent whole with
truncation auto, against the turns the server kept sent by the client itself (truncation off). One `tandem serve
--in-process` (real pair, bf16, AUTO, `--max-prompt-tokens 4096`).

A conversation of N turns (each a shipped prompt and a ~300-token answer), N = 8, 16, 32 (2755 tokens at 8; the
other two past the limit): per N, the whole conversation with truncation auto and the kept turns alone
(read back from the stored response's input_items), the order alternated, 3 times each, 16 tokens greedy, whole
responses: seconds, input tokens, the turns kept, the text; and `responses.input_tokens.count` of the whole with
truncation auto (its seconds, and that it equals the response's input tokens).

    PYTHONPATH=services python docs/bench/truncation-v1.py docs/bench/truncation-v1.json   # ~8 min on CPU-A
"""
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tandem.bench.local_cluster import serve_process
from tandem.bench.prompts import load_prompts
from tandem.sessions.embedded import free_port

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
LIMIT = 4096
QUESTIONS = load_prompts()
ANSWER = ("Here is one way to do it, step by step, with the reasoning behind each choice. " * 16).strip()


def message(role: str, text: str) -> dict:
    kind = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}


def conversation(turns: int) -> list[dict]:
    items = []
    for turn in range(turns):
        items += [message("user", f"({turn}) {QUESTIONS[turn % len(QUESTIONS)]}"), message("assistant", ANSWER)]
    return items + [message("user", "Now summarise what we did in one sentence.")]


def respond(client: httpx.Client, items: list[dict], truncation: str) -> dict:
    body = {"input": items, "truncation": truncation, "max_output_tokens": 16, "temperature": 0}
    began = time.perf_counter()
    response = client.post("/v1/responses", json=body)
    seconds = time.perf_counter() - began
    assert response.status_code == 200, response.text
    answer = response.json()
    return {"seconds": round(seconds, 3), "input_tokens": answer["usage"]["input_tokens"], "id": answer["id"],
            "text": answer["output"][0]["content"][0]["text"] if answer["output"] else ""}


def kept_items(client: httpx.Client, response_id: str) -> list[dict]:
    items, after = [], None
    while True:
        page = client.get(f"/v1/responses/{response_id}/input_items",
                          params={"order": "asc", "limit": 100} | ({"after": after} if after else {})).json()
        items += page["data"]
        if not page["has_more"]:
            return items
        after = page["last_id"]


def counted(client: httpx.Client, items: list[dict]) -> tuple[int, float]:
    began = time.perf_counter()
    answer = client.post("/v1/responses/input_tokens", json={"input": items, "truncation": "auto"}).json()
    return answer["input_tokens"], round(time.perf_counter() - began, 4)


port = free_port()
flags = ["--target", TARGET, "--draft", DRAFT, "--in-process", "--dtype", "bfloat16", "--threads", "2",
         "--max-prompt-tokens", str(LIMIT)]
rows = []
with tempfile.TemporaryDirectory() as scratch, serve_process(flags, Path(scratch) / "serve.log", timeout_s=1800,
                                                             http_port=port), \
        httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=1800) as client:
    respond(client, [message("user", "Say hello.")], "disabled")  # warm-up
    for turns in (8, 16, 32):
        items = conversation(turns)
        first = respond(client, items, "auto")
        kept = [{key: item[key] for key in ("type", "role", "content")} for item in kept_items(client, first["id"])]
        runs = {"auto": [first], "kept": []}
        for repeat in range(3):
            order = ("kept", "auto") if repeat % 2 == 0 else ("auto", "kept")
            for way in order:
                runs[way].append(respond(client, items if way == "auto" else kept,
                                         "auto" if way == "auto" else "disabled"))
        count, count_s = counted(client, items)
        row = {"turns": turns, "items": len(items), "kept_items": len(kept), "count": count, "count_s": count_s,
               "runs": runs}
        row |= {f"{way}_seconds": statistics.median(r["seconds"] for r in runs[way][-3:]) for way in runs}
        row["auto_over_kept"] = round(row["auto_seconds"] / row["kept_seconds"], 3)
        row["same_input_tokens"] = all(r["input_tokens"] == runs["kept"][0]["input_tokens"]
                                       for way in runs for r in runs[way])
        row["count_equals_usage"] = count == first["input_tokens"]
        row["same_text"] = len({r["text"] for way in runs for r in runs[way]}) == 1
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "runs"}), flush=True)
        Path(sys.argv[1]).write_text(json.dumps({"limit": LIMIT, "rows": rows}, indent=1) + "\n")
