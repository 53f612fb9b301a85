"""A chat's next turn as an OpenAI client sends it (the whole conversation again, no session id), with prefix caching
and without: `tandem serve --in-process` with the real pair (bf16, AUTO), servers in the order ON OFF OFF ON, the same
calibration for all four (the first start's, kept in a file).

Per server and per shipped prompt, over HTTP's chat completions, streamed, greedy, 96 tokens: turn 1 (the prompt),
then turn 2 (turn 1's question and answer, then a follow-up question). Reports each turn's time to first token and
seconds, the prompt tokens reported cached, and whether turn 2's text is the same with and without the cache.

    PYTHONPATH=services python docs/bench/turns-prefix-v1.py docs/bench/turns-prefix-v1.json   # ~20 min on CPU-A
"""
import json
import statistics
import sys
import tempfile
from pathlib import Path

from tandem.bench.local_cluster import serve_process
from tandem.bench.prompts import load_prompts
from tandem.bench.sse import streamed
from tandem.sessions.embedded import free_port

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
FOLLOW_UP = "Now add type hints and a docstring, and explain the complexity."
MAX_TOKENS = 96
QUESTIONS = load_prompts()


def chat(url: str, messages: list[dict]) -> dict:
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    return streamed(f"{url}/v1/chat/completions", body, lambda choice: choice.get("delta", {}).get("content") or "",
                    first_needs_text=True)


def sitting(mode: str, costs: str) -> dict:
    port = free_port()
    flags = ["--target", TARGET, "--draft", DRAFT, "--in-process", "--dtype", "bfloat16", "--threads", "2"]
    flags += ["--no-prefix-cache"] if mode == "off" else []
    turns = []
    with tempfile.TemporaryDirectory() as scratch, serve_process(flags, Path(scratch) / "serve.log", timeout_s=1800,
                                                                 costs_file=costs, http_port=port):
        url = f"http://127.0.0.1:{port}"
        chat(url, [{"role": "user", "content": "Say hello."}])  # warm-up
        for question in QUESTIONS:
            first = chat(url, [{"role": "user", "content": question}])
            second = chat(url, [{"role": "user", "content": question}, {"role": "assistant", "content": first["text"]},
                                {"role": "user", "content": FOLLOW_UP}])
            turns.append({"first": first, "second": second})
    row = {"mode": mode, "turns": turns}
    print(json.dumps({"mode": mode, "second_ttft_s": [t["second"]["ttft_s"] for t in turns],
                      "second_cached": [t["second"]["cached_tokens"] for t in turns],
                      "second_prompt_tokens": [t["second"]["prompt_tokens"] for t in turns]}), flush=True)
    return row


def pooled(rows: list[dict], mode: str) -> dict:
    turns = [t for r in rows if r["mode"] == mode for t in r["turns"]]

    def mean(values) -> float:
        return round(statistics.mean(values), 3)

    return {"second_ttft_s": mean(t["second"]["ttft_s"] for t in turns),
            "second_seconds": mean(t["second"]["seconds"] for t in turns),
            "first_ttft_s": mean(t["first"]["ttft_s"] for t in turns),
            "second_cached_tokens": mean(t["second"]["cached_tokens"] for t in turns),
            "second_prompt_tokens": mean(t["second"]["prompt_tokens"] for t in turns)}


with tempfile.TemporaryDirectory() as kept:
    costs = str(Path(kept) / "costs.json")
    rows = []
    for mode in ("on", "off", "off", "on"):
        rows.append(sitting(mode, costs))
        Path(sys.argv[1]).write_text(json.dumps({"rows": rows}, indent=1) + "\n")  # so far
on, off = pooled(rows, "on"), pooled(rows, "off")
same = [sum(a["second"]["text"] == b["second"]["text"] for a, b in zip(x["turns"], y["turns"], strict=True))
        for x, y in ((rows[0], rows[1]), (rows[3], rows[2]))]
summary = {"on": on, "off": off,
           **{f"{key}_off_over_on": round(off[key] / on[key], 3) for key in ("second_ttft_s", "second_seconds")},
           "same_second_turn_text_on_vs_off": [f"{n}/{len(QUESTIONS)}" for n in same]}
Path(sys.argv[1]).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1) + "\n")
print(json.dumps(summary))
