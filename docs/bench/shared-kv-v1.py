"""Two gateways on one full shared target replica: does another gateway's urgent request run, wait, or fail?

One Ray head on loopback, `tandem pools start` (one draft worker, one target replica, the real pair) with a KV budget
(KV_TOKENS) that holds three of the background sequences whole, and two `tandem gateway` processes. Gateway A
streams three greedy requests of BACKGROUND_TOKENS at `priority` 5 (the short chat prompts); once each has WAIT_FOR
tokens, four such sequences no longer fit (the budget is slots x longest), and gateway B sends one interactive
request of INTERACTIVE_TOKENS (priority 0), then, once that ends, one of priority 5 (A's, arriving later). For each:
how it ended (ok, or the error), seconds to its first token and to its end, its tokens; for A's: the same, and
whether their tokens equal their tokens run alone afterwards (greedy); the target worker's evictions.

The code measured is whichever `tandem` is on PYTHONPATH, so the same script measures a worktree of an older commit:

    PYTHONPATH=services python docs/bench/shared-kv-v1.py docs/bench/shared-kv-v1.json
    git worktree add /tmp/before 3fe0ddb
    PYTHONPATH=/tmp/before/services python docs/bench/shared-kv-v1.py docs/bench/shared-kv-before-v1.json
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import tandem
from loadtest.prompts import load_set
from tandem.bench.local_cluster import pools_status, run_tandem, start_gateway, start_ray_head
from tandem.client import TandemClient

BACKGROUND, BACKGROUND_TOKENS, INTERACTIVE_TOKENS = 3, 128, 32
LONGEST_PROMPT = 38  # tokens, the short chat prompts with the chat template
KV_TOKENS = 3 * (LONGEST_PROMPT + BACKGROUND_TOKENS) + 12  # three whole background sequences, with a little margin
GATEWAY_FLAGS = ("--max-batch", "4")
WAIT_FOR = KV_TOKENS // 4 - LONGEST_PROMPT + 8  # background tokens past which a fourth sequence cannot fit


T0 = time.perf_counter()  # every record's `sent_s` counts from the start of the run


def stream(address: str, prompt, priority: int, max_tokens: int, record: dict) -> None:
    began = time.perf_counter()
    record.update(tokens=[], status="running", priority=priority, sent_s=round(began - T0, 2))
    try:
        with TandemClient(address, timeout=900) as client:
            for item in client.generate(**prompt.request_input(), temperature=0.0, max_tokens=max_tokens,
                                        ignore_eos=True, priority=priority):
                ids = list(getattr(item, "token_ids", []))
                if ids and "first_token_s" not in record:
                    record["first_token_s"] = round(time.perf_counter() - began, 2)
                record["tokens"] += ids
        record["status"] = "ok"
    except Exception as exc:  # the outcome measured: how the request ended
        record["status"] = f"{type(exc).__name__}: {exc}"[:300]
    record["end_s"] = round(time.perf_counter() - began, 2)


def main(out: str) -> int:
    prompts = [p for p in load_set("chat") if p.length == "short"]
    global T0
    head, address = start_ray_head(tempfile.mkdtemp(prefix="tandem-ray-"))
    gateways: list[subprocess.Popen] = []
    report: dict = {"code": tandem.__file__, "kv_tokens": KV_TOKENS, "background_tokens": BACKGROUND_TOKENS,
                    "interactive_tokens": INTERACTIVE_TOKENS, "wait_for": WAIT_FOR}
    try:
        run_tandem(address, "pools", "start", "--name", "kv", "--threads", "1", "--draft-workers", "1",
                   "--target-replicas", "1", "--kv-tokens", str(KV_TOKENS))
        logs = Path(tempfile.mkdtemp(prefix="tandem-gw-"))
        a, b = (start_gateway(address, "kv", GATEWAY_FLAGS, log=logs / f"gateway-{i}.err", started=gateways).address
                for i in range(2))
        background: list[dict] = [{} for _ in range(BACKGROUND)]
        T0 = time.perf_counter()
        threads = [threading.Thread(target=stream, args=(a, prompts[i], 5, BACKGROUND_TOKENS, background[i]))
                   for i in range(BACKGROUND)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 1800
        while time.monotonic() < deadline and not all(
                len(run.get("tokens", ())) >= WAIT_FOR or run.get("status") not in (None, "running")
                for run in background):
            time.sleep(0.2)
        report["interactive"] = {}
        stream(b, prompts[BACKGROUND], 0, INTERACTIVE_TOKENS, report["interactive"])
        report["same_priority_later"] = {}
        stream(b, prompts[BACKGROUND + 1], 5, INTERACTIVE_TOKENS, report["same_priority_later"])
        for thread in threads:
            thread.join(timeout=1800)
        report["background_runs"] = background
        report["evicted"] = sum(w.get("evicted", 0) for w in pools_status(address, "kv")["workers"])
        alone: list[dict] = [{} for _ in range(BACKGROUND)]
        for i in range(BACKGROUND):
            stream(a, prompts[i], 5, BACKGROUND_TOKENS, alone[i])
        report["background_equal_alone"] = [run["tokens"] == solo["tokens"] and run["status"] == "ok"
                                            for run, solo in zip(background, alone, strict=True)]
        for record in [report["interactive"], report["same_priority_later"], *background]:
            record["tokens"] = len(record["tokens"])
    finally:
        for gateway in gateways:
            gateway.terminate()
        head.terminate()
        head.wait(timeout=120)
    Path(out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
