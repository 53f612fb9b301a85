"""A client's costly grammar beside another client's request, before and after refusals of one row: `tandem serve
--in-process` with the real pair (bf16), one checkout after the other (before, after, after, before). Per server:
a free request alone (greedy, 256 tokens, streamed: its seconds), then the same request with a second one beside it
whose grammar is ambiguous (`e: e e | e e e | "a"`, ending in a "!" its logit bias keeps away, max_tokens 300):
the free request's seconds again, and how the formatted one ended (its status, its error, its seconds).

    git worktree add /tmp/before fb50f37
    PYTHONPATH=services python docs/bench/costly-grammar-v1.py /tmp/before/services services c.json   # ~15 min
"""
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from tandem.bench.local_cluster import serve_process
from tandem.models.loader import resolve
from tandem.sessions.embedded import free_port

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
SLOW = 'start: e "!"\ne: e e | e e e | "a"'
FREE = {"messages": [{"role": "user", "content": "Write a Python function that merges two sorted lists."}],
        "max_tokens": 256, "temperature": 0, "ignore_eos": True, "stream": True}
before, after, out = sys.argv[1], sys.argv[2], sys.argv[3]


def streamed_seconds(url: str) -> float:
    started = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=FREE, timeout=1800) as response:
        assert response.status_code == 200, response.read()
        for _ in response.iter_lines():
            pass
    return time.perf_counter() - started


def bangs() -> list[int]:
    """The ids whose text the grammar allows and ends the output with: runs of "!" (the grammar's "a" runs aside)."""
    tokenizer = AutoTokenizer.from_pretrained(resolve(TARGET, progress=False).path)
    return [i for i in range(len(tokenizer)) if "!" in (text := tokenizer.decode([i])) and set(text) <= {"!", "a"}]


def costly(url: str, bang: list[int], sink: dict) -> None:
    started = time.perf_counter()
    response = httpx.post(f"{url}/v1/chat/completions", timeout=1800, json={
        "messages": [{"role": "user", "content": "Write the letter a many times."}], "max_tokens": 300,
        "temperature": 0, "structured_outputs": {"grammar": SLOW}, "logit_bias": {str(i): -100 for i in bang}})
    body = response.json()
    sink.update(status=response.status_code, seconds=round(time.perf_counter() - started, 2),
                error=body.get("error", {}).get("message"),
                tokens=body.get("usage", {}).get("completion_tokens"),
                finish=(body.get("choices") or [{}])[0].get("finish_reason"))


def sitting(services: str, label: str) -> dict:
    port = free_port()
    flags = ["--target", TARGET, "--draft", DRAFT, "--in-process", "--dtype", "bfloat16"]
    with tempfile.TemporaryDirectory() as scratch, serve_process(flags, Path(scratch) / "serve.log", services,
                                                                 timeout_s=1800, http_port=port):
        url = f"http://127.0.0.1:{port}"
        alone = streamed_seconds(url)
        outcome: dict = {}
        beside = threading.Thread(target=costly, args=(url, BANGS, outcome))
        beside.start()
        time.sleep(1.0)  # the costly request is running
        with_costly = streamed_seconds(url)
        beside.join()
    row = {"label": label, "free_alone_s": round(alone, 2), "free_beside_costly_s": round(with_costly, 2),
           "slowdown": round(with_costly / alone, 3), "costly": outcome}
    print(json.dumps(row), flush=True)
    return row


BANGS = bangs()
rows = [sitting(path, label) for path, label in ((before, "before"), (after, "after"), (after, "after"),
                                                  (before, "before"))]
summary = {label: {"slowdown": [r["slowdown"] for r in rows if r["label"] == label],
                   "costly_seconds": [r["costly"]["seconds"] for r in rows if r["label"] == label]}
           for label in ("before", "after")}
Path(out).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1) + "\n")
print(json.dumps(summary))
