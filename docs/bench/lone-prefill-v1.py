"""A long prompt's prefill with nothing else running, served, capped per step (`--max-prefill-tokens`) or not (0,
the engine before the cap): what a request arriving meanwhile waits, what an abort frees, what the cap costs.

Three resident `tandem serve --in-process` servers (the real pair, bf16, AUTO, `--no-prefix-cache` so that a
repeated prompt is computed again), at caps of 0, 512 and 2048 tokens, sharing one calibration. The long prompt is
LONG_TOKENS tokens of docs/architecture.md sent as token ids to the completions API, streamed, max_tokens 1. Per
repeat, each server in turn (the order rotating), three scenes:
- alone: the long request by itself (its time to first token: the cap's cost);
- arrival: the long request, then ARRIVAL_S later a short one (a shipped prompt, 8 tokens, greedy): the short one's
  time to first token and seconds, and the long one's time to first token;
- abort: the long request's client disconnects after ARRIVAL_S, then the short one is sent at once;
- after_first (only when asked): the long request decodes AFTER_TOKENS tokens, the short one is sent as its first
  token comes, while its drafter is a whole prompt behind.

    PYTHONPATH=services python docs/bench/lone-prefill-v1.py out.json --repeats 2     # ~20 min on 2 cores
    PYTHONPATH=services python docs/bench/lone-prefill-v1.py alone.json --caps 0 512 --scenes alone --repeats 4
    PYTHONPATH=services python docs/bench/lone-prefill-v1.py after.json --caps 0 512 --scenes after_first
"""
import argparse
import contextlib
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from tandem.bench.local_cluster import serve_process
from tandem.bench.prompts import load_prompts
from tandem.bench.sse import streamed
from tandem.models.loader import resolve
from tandem.sessions.embedded import free_port

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
CAPS = (0, 512, 2048)
LONG_TOKENS = 4000
ARRIVAL_S = 3.0
AFTER_TOKENS = 48
TOKENIZER = AutoTokenizer.from_pretrained(resolve(TARGET, progress=False).path)
LONG = TOKENIZER((Path(__file__).parents[1] / "architecture.md").read_text())["input_ids"][:LONG_TOKENS]
SHORT = TOKENIZER.apply_chat_template([{"role": "user", "content": load_prompts()[0]}], tokenize=True,
                                      add_generation_prompt=True, return_dict=True)["input_ids"]


def body(ids: list[int], max_tokens: int) -> dict:
    return {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


def request(url: str, ids: list[int], max_tokens: int) -> dict:
    return streamed(f"{url}/v1/completions", body(ids, max_tokens), lambda choice: choice.get("text") or "")


def alone(url: str) -> dict:
    return {"long_ttft_s": request(url, LONG, 1)["ttft_s"]}


def arrival(url: str) -> dict:
    long: dict = {}
    thread = threading.Thread(target=lambda: long.update(request(url, LONG, 1)))
    thread.start()
    time.sleep(ARRIVAL_S)
    short = request(url, SHORT, 8)
    thread.join()
    return {"short_ttft_s": short["ttft_s"], "short_s": short["seconds"], "long_ttft_s": long["ttft_s"]}


def after_first(url: str) -> dict:
    """The long request decodes AFTER_TOKENS tokens; the short one is sent as its first token comes, when its
    drafter is a whole prompt behind (its catch-up: at once uncapped, max_prefill_tokens a round capped)."""
    first = threading.Event()
    long: dict = {}

    def run() -> None:
        long.update(streamed(f"{url}/v1/completions", body(LONG, AFTER_TOKENS),
                             lambda choice: first.set() or choice.get("text") or ""))

    thread = threading.Thread(target=run)
    thread.start()
    first.wait()
    short = request(url, SHORT, 8)
    thread.join()
    return {"short_ttft_s": short["ttft_s"], "short_s": short["seconds"], "long_s": long["seconds"]}


def abort(url: str) -> dict:
    # the client gives up: its connection closes
    with (contextlib.suppress(httpx.TimeoutException),
          httpx.stream("POST", f"{url}/v1/completions", json=body(LONG, 1), timeout=ARRIVAL_S) as response):
        for _ in response.iter_lines():
            pass
    short = request(url, SHORT, 8)
    return {"short_ttft_s": short["ttft_s"], "short_s": short["seconds"]}


SCENES = {"alone": alone, "arrival": arrival, "abort": abort, "after_first": after_first}
DEFAULT_SCENES = ("alone", "arrival", "abort")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("json")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--caps", type=int, nargs="+", default=list(CAPS))
    parser.add_argument("--scenes", nargs="+", choices=list(SCENES), default=list(DEFAULT_SCENES))
    args = parser.parse_args()
    caps = tuple(args.caps)
    rows: list[dict] = []
    with contextlib.ExitStack() as stack:
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        urls = {}
        for cap in caps:
            port = free_port()
            flags = ["--target", TARGET, "--draft", DRAFT, "--in-process", "--dtype", "bfloat16", "--threads", "2",
                     "--no-prefix-cache", "--max-prefill-tokens", str(cap)]
            stack.enter_context(serve_process(flags, scratch / f"serve-{cap}.log", timeout_s=1800,
                                              costs_file=str(scratch / "costs.json"), http_port=port))
            urls[cap] = f"http://127.0.0.1:{port}"
            request(urls[cap], SHORT, 8)  # warm-up
        for repeat in range(args.repeats):
            order = caps[repeat % len(caps):] + caps[:repeat % len(caps)]
            for cap in order:
                row = {"repeat": repeat, "cap": cap} | {scene: SCENES[scene](urls[cap]) for scene in args.scenes}
                rows.append(row)
                print(json.dumps(row), flush=True)
                Path(args.json).write_text(json.dumps({"rows": rows}, indent=1) + "\n")

    def median(cap: int, scene: str, key: str) -> float:
        return round(statistics.median(r[scene][key] for r in rows if r["cap"] == cap), 3)

    summary = {str(cap): {f"{scene}_{key}": median(cap, scene, key)
                          for scene, keys in (("alone", ("long_ttft_s",)),
                                              ("arrival", ("short_ttft_s", "short_s", "long_ttft_s")),
                                              ("abort", ("short_ttft_s", "short_s")),
                                              ("after_first", ("short_ttft_s", "short_s", "long_s")))
                          if scene in args.scenes for key in keys} for cap in caps}
    result = {"long_prompt_tokens": len(LONG), "short_prompt_tokens": len(SHORT), "arrival_s": ARRIVAL_S,
              "rows": rows, "summary": summary}
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
