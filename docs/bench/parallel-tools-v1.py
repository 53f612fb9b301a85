"""parallel_tool_calls false with the real pair: `tandem serve --in-process` (bf16 on a CPU with AVX512-BF16, AUTO),
6 chats that call for two tool calls, each with the agent's system prompt and 4 tools of the prefix-caching benches
(tandem.bench.agent_prompts), chat completions over HTTP, greedy, 192 tokens, each
chat asked with the default (calls in parallel allowed) and with parallel_tool_calls false, which one first
alternating chat by chat. Per request: the calls the gateway parsed, the finish reason, completion tokens, seconds;
whether the single call is the default's first.

    PYTHONPATH=services python docs/bench/parallel-tools-v1.py docs/bench/parallel-tools-v1.json   # ~8 min on CPU-A

With a second argument, the tool_choice every request sends (`required`: parallel-tools-required-v1.json).
"""
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tandem.bench.agent_prompts import SYSTEM, TOOLS
from tandem.bench.local_cluster import serve_process
from tandem.sessions.embedded import free_port

CHATS = ["Check the status of the billing service in eu-west and in us-east.",
         "Read src/app.py and src/db.py.",
         "Search the docs for rate limits and for retry policies.",
         "Run code that prints 2**64, and run code that prints the current year.",
         "Is the auth service healthy? Also search the docs for its runbook.",
         "Read README.md, then compute 17 * 23 by running code."]
MAX_TOKENS = 192
TOOL_CHOICE = sys.argv[2] if len(sys.argv) > 2 else None  # the default's: "auto"


def ask(url: str, chat: str, parallel: bool) -> dict:
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": chat}], "tools": TOOLS,
            "temperature": 0, "max_tokens": MAX_TOKENS} | ({} if parallel else {"parallel_tool_calls": False})
    if TOOL_CHOICE is not None:
        body["tool_choice"] = TOOL_CHOICE
    started = time.perf_counter()
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=1800)
    seconds = time.perf_counter() - started
    assert response.status_code == 200, response.text
    answer = response.json()
    choice = answer["choices"][0]
    return {"calls": [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                      for c in choice["message"].get("tool_calls") or ()],
            "finish_reason": choice["finish_reason"], "text": choice["message"]["content"],
            "completion_tokens": answer["usage"]["completion_tokens"], "seconds": round(seconds, 3)}


port = free_port()
flags = ["--target", "qwen2.5-coder-1.5b-instruct", "--draft", "qwen2.5-coder-0.5b-instruct", "--in-process",
         "--dtype", "auto"]
rows = []
with tempfile.TemporaryDirectory() as scratch, serve_process(flags, Path(scratch) / "serve.log", timeout_s=1800,
                                                             http_port=port):
    url = f"http://127.0.0.1:{port}"
    ask(url, "Say hello.", True)  # warm-up
    for index, chat in enumerate(CHATS):
        order = (True, False) if index % 2 == 0 else (False, True)
        row = {"chat": chat} | {("parallel" if parallel else "single"): ask(url, chat, parallel) for parallel in order}
        row["single_is_first_of_parallel"] = (bool(row["single"]["calls"]) and
                                              row["single"]["calls"][0] == (row["parallel"]["calls"] or [None])[0])
        rows.append(row)
        print(json.dumps({"chat": chat, "calls": [len(row[w]["calls"]) for w in ("parallel", "single")],
                          "tokens": [row[w]["completion_tokens"] for w in ("parallel", "single")]}), flush=True)


def total(way: str, key: str) -> float:
    return round(sum(row[way][key] for row in rows), 3)


summary = {"calls_parallel": [len(row["parallel"]["calls"]) for row in rows],
           "calls_single": [len(row["single"]["calls"]) for row in rows],
           "finish_single": [row["single"]["finish_reason"] for row in rows],
           "single_is_first_of_parallel": f"{sum(row['single_is_first_of_parallel'] for row in rows)}/{len(rows)}",
           "completion_tokens": {"parallel": total("parallel", "completion_tokens"),
                                 "single": total("single", "completion_tokens")},
           "seconds": {"parallel": total("parallel", "seconds"), "single": total("single", "seconds")},
           "seconds_where_parallel_made_2_or_more": {
               way: round(statistics.fsum(row[way]["seconds"] for row in rows if len(row["parallel"]["calls"]) > 1), 3)
               for way in ("parallel", "single")}}
record = {"max_tokens": MAX_TOKENS, "tool_choice": TOOL_CHOICE, "rows": rows, "summary": summary}
Path(sys.argv[1]).write_text(json.dumps(record, indent=1) + "\n")
print(json.dumps(summary))
