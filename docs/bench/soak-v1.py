"""Memory over a long run: `tandem serve` (its own Ray, one draft worker, one target replica) over the tiny pair,
float32, 1 thread a model, driven with REQUESTS short greedy requests, 8 at a time over gRPC: a third continue a
session (multi-turn, their caches retained), a third share a prefix with an earlier one, the rest are fresh; a
sixteenth are cancelled mid-stream. Every SAMPLE requests, the resident memory (RSS) of the gateway and of each Ray
worker actor; the slope in MB per 10k requests over the second half tells a leak (growing on) from an allocator
settling (flat once warm).

    PYTHONPATH=services python docs/bench/soak-v1.py soak.json [REQUESTS [fixed]]    # 100000: 40 min on CPU-A
"""
import json
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import psutil

from tandem.bench.local_cluster import serve_process
from tandem.client import TandemClient
from tandem.models.tiny import make_tiny

REQUESTS = int(sys.argv[2]) if len(sys.argv) > 2 else 100_000
# `fixed`: the sessions are 64 ids used over and over, so no new session's state is kept: what the gateway's memory
# does without its session cache growing (a Redis store keeps up to 100,000 sessions' state in memory for an hour).
FIXED_SESSIONS = sys.argv[3:4] == ["fixed"]
SAMPLE, IN_FLIGHT, TOKENS = 2000, 8, 12
ROLES = ("DraftWorker", "TargetWorker")  # Ray names an actor's process ray::<class>


def memory(gateway: psutil.Process) -> dict[str, float]:
    """MB resident per process: the gateway, and each worker actor it started (by its class, numbered): the actors
    are processes under its own Ray's raylet, so another Ray's on the machine are not counted."""
    found = {"gateway": gateway.memory_info().rss / 2**20}
    counts: dict[str, int] = {}
    for process in gateway.children(recursive=True):
        try:
            title, rss = " ".join(process.cmdline()), process.memory_info().rss
        except psutil.NoSuchProcess:
            continue
        for role in ROLES:
            if title.startswith(f"ray::{role}"):
                index = counts[role] = counts.get(role, -1) + 1
                found[f"{role}-{index}"] = rss / 2**20
    return {name: round(mb, 1) for name, mb in found.items()}


def one(client: TandemClient, n: int, rng: random.Random, sessions: list[str], lock: threading.Lock) -> None:
    kind = n % 3
    prompt = [rng.randrange(3, 250) for _ in range(rng.randrange(4, 40))]
    options = {"temperature": 0.0, "max_tokens": TOKENS, "ignore_eos": True, "request_id": f"soak-{n}"}
    if kind == 0:
        with lock:
            session = sessions[n % len(sessions)] if sessions and n % 2 else f"s{n % 64 if FIXED_SESSIONS else n}"
            if session not in sessions:
                sessions.append(session)
                del sessions[:-64]  # at most 64 live sessions, the older ones left to expire
        options["session_id"] = session
    elif kind == 1:
        prompt = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18] + prompt  # a prefix every such request shares
    stream = client.generate(token_ids=prompt, **options)
    try:
        for index, _ in enumerate(stream):
            if n % 16 == 5 and index == 2:  # a client that walks away mid-stream
                stream.close()  # the client cancels the call
                break
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.CANCELLED:
            raise


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        tiny = make_tiny(Path(scratch) / "tiny", seed=0)
        flags = ["--target", str(tiny.target), "--draft", str(tiny.draft), "--threads", "1", "--dtype", "float32"]
        with serve_process(flags, Path(scratch) / "serve.log") as (address, _):
            gateway = next(p for p in psutil.process_iter(["cmdline"])  # the one serving this run's models
                           if "serve" in (p.info["cmdline"] or ()) and str(tiny.target) in (p.info["cmdline"] or ()))
            rng, sessions, lock = random.Random(0), [], threading.Lock()
            preloads = {}  # the allocator each process runs with: glibc's malloc, or tcmalloc preloaded
            started = time.monotonic()
            with TandemClient(address, timeout=120) as client, ThreadPoolExecutor(IN_FLIGHT) as pool:
                for done in range(0, REQUESTS, SAMPLE):
                    list(pool.map(lambda n: one(client, n, rng, sessions, lock), range(done, done + SAMPLE)))
                    row = {"requests": done + SAMPLE, "seconds": round(time.monotonic() - started, 1)} | memory(gateway)
                    rows.append(row)
                    if not preloads:
                        preloads = {" ".join(p.cmdline())[:40]: p.environ().get("LD_PRELOAD", "")
                                    for p in [gateway, *gateway.children(recursive=True)]
                                    if " ".join(p.cmdline()).startswith(("ray::", sys.executable)) or p == gateway}
                    print(json.dumps(row), flush=True)
    half = rows[len(rows) // 2 - 1:]
    slopes = {name: round((half[-1][name] - half[0][name]) / (half[-1]["requests"] - half[0]["requests"]) * 1e4, 2)
              for name in rows[-1] if name not in ("requests", "seconds") and name in half[0]}
    record = {"requests": REQUESTS, "fixed_sessions": FIXED_SESSIONS, "ld_preload": preloads, "sample": SAMPLE,
              "in_flight": IN_FLIGHT, "tokens": TOKENS, "mb_per_10k_requests_second_half": slopes, "rows": rows}
    Path(sys.argv[1]).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({"mb_per_10k_requests_second_half": slopes}))


main()
