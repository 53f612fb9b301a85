"""Prefix caching on and off, served: `tandem serve --in-process` with the real pair (bf16, AUTO), one server after the
other in the order ON OFF OFF ON, the same calibration for all four (the first start's, kept in a file).

An agent's requests: every chat carries the same system prompt and four tool definitions (the shared prefix) and a
question of its own (the 8 shipped prompts), rendered by the target's chat template and sent as token ids to the
completions API (which streams each token as it comes; the chat API holds a tool call back until it is whole),
streamed, greedy, 48 tokens (`ignore_eos`). Per server: one warm-up request (its own question; untimed), then the 8
questions one at a time (time to first token and seconds of each), then the 8 again at once, each begun with
"Briefly: " so that they share only the system prompt and tools with what came before (wall seconds, mean time to
first token). Outputs of ON and OFF are compared as texts.

    PYTHONPATH=services python docs/bench/prefix-cache-v1.py docs/bench/prefix-cache-v1.json   # ~25 min
"""
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from transformers import AutoTokenizer

from tandem.bench.agent_prompts import agent_prompt_ids
from tandem.bench.local_cluster import serve_process
from tandem.bench.prompts import load_prompts
from tandem.bench.sse import streamed
from tandem.models.loader import resolve
from tandem.sessions.embedded import free_port

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
QUESTIONS = load_prompts()
WARM_UP = "Which tool would you use to find the on-call rotation of the payments team?"
MAX_TOKENS = 48
TOKENIZER = AutoTokenizer.from_pretrained(resolve(TARGET, progress=False).path)


def prompt_ids(question: str) -> list[int]:
    """Token ids for the completions API, which streams every token as it comes (the chat API holds a tool call's
    tokens back until the call is whole, hiding the first token)."""
    return agent_prompt_ids(TOKENIZER, question)


def chat(url: str, question: str) -> dict:
    """One streamed request: its time to first token, seconds, text and prompt tokens."""
    body = {"prompt": prompt_ids(question), "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    return streamed(f"{url}/v1/completions", body, lambda choice: choice.get("text") or "")


def at_once(url: str, questions: list[str]) -> tuple[float, list[dict]]:
    results: list[dict] = [{}] * len(questions)

    def one(index: int) -> None:
        results[index] = chat(url, questions[index])

    started = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(questions))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started, results


def sitting(mode: str, costs: str) -> dict:
    port = free_port()
    flags = ["--target", TARGET, "--draft", DRAFT, "--in-process", "--dtype", "bfloat16", "--threads", "2"]
    flags += ["--no-prefix-cache"] if mode == "off" else []
    with tempfile.TemporaryDirectory() as scratch, serve_process(flags, Path(scratch) / "serve.log", timeout_s=1800,
                                                                 costs_file=costs, http_port=port):
        url = f"http://127.0.0.1:{port}"
        chat(url, WARM_UP)
        one_at_a_time = [chat(url, q) for q in QUESTIONS]
        wall, together = at_once(url, ["Briefly: " + q for q in QUESTIONS])
    row = {"mode": mode,
           "one_at_a_time": {"ttft_s": [r["ttft_s"] for r in one_at_a_time],
                             "seconds": [r["seconds"] for r in one_at_a_time],
                             "prompt_tokens": [r["prompt_tokens"] for r in one_at_a_time],
                             "cached_tokens": [r["cached_tokens"] for r in one_at_a_time]},
           "at_once": {"wall_s": round(wall, 3), "ttft_s": [r["ttft_s"] for r in together],
                       "cached_tokens": [r["cached_tokens"] for r in together]},
           "texts": [r["text"] for r in one_at_a_time + together]}
    print(json.dumps({k: v for k, v in row.items() if k != "texts"}), flush=True)
    return row


def pooled(rows: list[dict], mode: str) -> dict:
    mine = [r for r in rows if r["mode"] == mode]

    def mean(values) -> float:
        return round(statistics.mean(values), 3)

    return {"ttft_one_s": mean(t for r in mine for t in r["one_at_a_time"]["ttft_s"]),
            "seconds_one": mean(s for r in mine for s in r["one_at_a_time"]["seconds"]),
            "wall_at_once_s": mean(r["at_once"]["wall_s"] for r in mine),
            "ttft_at_once_s": mean(t for r in mine for t in r["at_once"]["ttft_s"])}


with tempfile.TemporaryDirectory() as kept:
    costs = str(Path(kept) / "costs.json")
    rows = []
    for mode in ("on", "off", "off", "on"):
        rows.append(sitting(mode, costs))
        Path(sys.argv[1]).write_text(json.dumps({"rows": rows}, indent=1) + "\n")  # so far
on, off = pooled(rows, "on"), pooled(rows, "off")
same = [sum(a == b for a, b in zip(x["texts"], y["texts"], strict=True))
        for x, y in ((rows[0], rows[1]), (rows[3], rows[2]))]
summary = {"on": on, "off": off, **{f"{key}_off_over_on": round(off[key] / on[key], 3) for key in on},
           "same_text_on_vs_off": [f"{n}/{2 * len(QUESTIONS)}" for n in same],
           "prompt_tokens": rows[0]["one_at_a_time"]["prompt_tokens"]}
Path(sys.argv[1]).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1) + "\n")
print(json.dumps(summary))
