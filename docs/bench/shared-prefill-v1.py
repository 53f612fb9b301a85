"""A long prompt on one gateway beside another gateway's decoding stream, on shared pools: what the stream waits.

One Ray head and `tandem pools start` (the real pair, bf16, one draft worker and one target replica, one thread
each); gateway B (this checkout) streams a chat prompt greedily; once it has DECODED_FIRST tokens, gateway A sends a
LONG_TOKENS-token prompt (random ids, new each run, so no cache holds it), max_tokens 1. Gateway A runs either
checkout: OLD (whose engine cuts a lone long prompt at --max-prefill-tokens, 512, whatever runs beside it on the
pools) or NEW (which cuts it at --prefill-chunk, 64, while another caller's sequence runs on its target worker, as it
does beside its own decoding rows). Per run: B's gaps between streamed chunks while A's prompt is prefilled (from
A's send to A's first token: median, p90, max), B's tokens a second in that window, and A's time to first token.
The checkouts alternate, OLD first in even repeats.

    git worktree add /tmp/old 0ca8016
    PYTHONPATH=services python docs/bench/shared-prefill-v1.py /tmp/old/services services out.json --repeats 2
"""
import argparse
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from tandem.bench.local_cluster import ray_env, run_tandem, start_ray_head, wait_serving
from tandem.client import TandemClient

LONG_TOKENS, DECODED_FIRST, B_TOKENS = 2048, 8, 2000
B_PROMPT = [("user", "Write a long, detailed Python module that implements a priority queue, with docstrings.")]


def gateway(address: str, services: str, started: list) -> str:
    env = ray_env(address) | {"PYTHONPATH": os.path.abspath(services)}
    process = subprocess.Popen([sys.executable, "-m", "tandem", "gateway", "--pools", "bench", "--port", "0",
                                "--metrics-port", "-1"], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True)
    started.append(process)
    return wait_serving(process, timeout_s=600)


def run(a_address: str, b_address: str, seed: int) -> dict:
    arrivals: list[tuple[float, int]] = []  # (when, tokens) per chunk of B's stream
    stop = threading.Event()
    b_ready = threading.Event()

    def stream_b() -> None:
        with TandemClient(b_address, timeout=900) as client:
            stream = client.generate(chat=B_PROMPT, temperature=0.0, max_tokens=B_TOKENS, ignore_eos=True)
            for item in stream:
                if getattr(item, "token_ids", None):
                    arrivals.append((time.perf_counter(), len(item.token_ids)))
                    if sum(n for _, n in arrivals) >= DECODED_FIRST:
                        b_ready.set()
                if stop.is_set():
                    stream.close()
                    return

    b = threading.Thread(target=stream_b)
    b.start()
    assert b_ready.wait(600), "gateway B's stream never started"
    prompt = [random.Random(seed).randrange(1000, 100000) for _ in range(LONG_TOKENS)]
    with TandemClient(a_address, timeout=900) as client:
        sent = time.perf_counter()
        first = None
        for item in client.generate(token_ids=prompt, temperature=0.0, max_tokens=1):
            if getattr(item, "token_ids", None) and first is None:
                first = time.perf_counter()
    stop.set()
    b.join(timeout=900)
    window = [(t, n) for t, n in arrivals if sent <= t <= first]
    # Gaps between B's chunks (a chunk holds a round's tokens), the one running into A's send included.
    before = [t for t, _ in arrivals if t < sent][-1:]
    times = before + [t for t, _ in window]
    gaps = sorted(later - earlier for earlier, later in itertools.pairwise(times)) or [first - sent]
    tokens = sum(n for _, n in window)
    return {"a_ttft_s": round(first - sent, 3), "b_tokens_in_window": tokens,
            "b_tokens_per_s_in_window": round(tokens / (first - sent), 3),
            "b_gap_median_s": round(statistics.median(gaps), 3),
            "b_gap_p90_s": round(gaps[int(0.9 * (len(gaps) - 1))], 3), "b_gap_max_s": round(gaps[-1], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("out")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    head, address = start_ray_head(tempfile.mkdtemp(prefix="tandem-ray-"))
    started: list[subprocess.Popen] = []
    runs = []
    try:
        run_tandem(address, "pools", "start", "--name", "bench", "--threads", "1", "--draft-workers", "1",
                   "--target-replicas", "1")
        b_address = gateway(address, args.new, started)
        a_addresses = {"old": gateway(address, args.old, started), "new": gateway(address, args.new, started)}
        for a_address in a_addresses.values():  # warm-up: each gateway's first rounds on the pools
            with TandemClient(a_address, timeout=900) as client:
                client.generate_text(chat=B_PROMPT, temperature=0.0, max_tokens=8)
        for repeat in range(args.repeats):
            for name in (["old", "new"] if repeat % 2 == 0 else ["new", "old"]):
                result = {"checkout": name, "repeat": repeat, **run(a_addresses[name], b_address, seed=len(runs))}
                print(json.dumps(result), file=sys.stderr, flush=True)
                runs.append(result)
    finally:
        for process in started:
            process.terminate()
        head.terminate()
        head.wait(timeout=120)
    summary = {name: {key: round(statistics.median(r[key] for r in runs if r["checkout"] == name), 3)
                      for key in runs[0] if key not in ("checkout", "repeat")} for name in ("old", "new")}
    report = {"long_tokens": LONG_TOKENS, "old": args.old, "new": args.new, "summary_medians": summary, "runs": runs}
    print(json.dumps(report, indent=1))
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
