"""Gateways sharing target replicas: where do their requests run, and how long do they take?

One Ray head on loopback, `tandem pools start --no-spec` with two target replicas of the real target (one thread
each, the two cores of this machine), and two `tandem gateway` processes. Each gateway streams REQUESTS greedy
requests of TOKENS tokens one after another (the short chat prompts), the two gateways at once, the second
STAGGER_S after the first (so the placement measured is the routing's, not a tie between arrivals in the same
instant). Per variant: the seconds until every request ended, tokens per second over them, each replica's forwards
and rows (pools status), and every request's tokens, which must be the same in every variant (greedy, float32).

Variants are the code on a PYTHONPATH each (this tree and a worktree of an older commit), run alternately in one
sitting, ROUNDS times each:

    git worktree add /tmp/before e29c463
    PYTHONPATH=services python docs/bench/shared-routing-v1.py docs/bench/shared-routing-v1.json \
        now=services before=/tmp/before/services
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from loadtest.prompts import load_set
from tandem.bench.local_cluster import pools_status, run_tandem, start_gateway, start_ray_head
from tandem.client import TandemClient

GATEWAYS, REQUESTS, TOKENS, ROUNDS, STAGGER_S = 2, 2, 64, 2, 2.0


def run_gateway(address: str, prompts: list, record: dict) -> None:
    record.update(tokens=[], status="running")
    try:
        with TandemClient(address, timeout=900) as client:
            for prompt in prompts:
                ids: list[int] = []
                for item in client.generate(**prompt.request_input(), temperature=0.0, max_tokens=TOKENS,
                                            ignore_eos=True):
                    ids += list(getattr(item, "token_ids", []))
                record["tokens"].append(ids)
        record["status"] = "ok"
    except Exception as exc:  # the outcome measured
        record["status"] = f"{type(exc).__name__}: {exc}"[:300]


def one_run(code: str) -> dict:
    """Every process of this run (Ray head and its workers, pools command, gateways) imports tandem from `code`."""
    os.environ["PYTHONPATH"] = str(Path(code).resolve())
    prompts = [p for p in load_set("chat") if p.length == "short"]
    head, address = start_ray_head(tempfile.mkdtemp(prefix="tandem-ray-"))
    gateways: list = []
    try:
        run_tandem(address, "pools", "start", "--name", "r", "--threads", "1", "--no-spec", "--target-replicas", "2")
        addresses = [start_gateway(address, "r", started=gateways).address for _ in range(GATEWAYS)]
        records = [{} for _ in range(GATEWAYS)]
        threads = [threading.Thread(target=run_gateway, args=(addresses[g], prompts[g * REQUESTS:(g + 1) * REQUESTS],
                                                             records[g])) for g in range(GATEWAYS)]
        began = time.perf_counter()
        for thread in threads:
            thread.start()
            time.sleep(STAGGER_S)
        for thread in threads:
            thread.join(timeout=1800)
        seconds = time.perf_counter() - began
        workers = [w for w in pools_status(address, "r")["workers"] if w["role"] == "target"]
        tokens = sum(len(ids) for record in records for ids in record["tokens"])
        return {"code": code, "seconds": round(seconds, 2), "tokens": tokens, "tok_s": round(tokens / seconds, 3),
                "status": [record["status"] for record in records],
                "replicas": {w["name"]: {"forwards": w["forwards"], "rows": w["rows"]} for w in workers},
                "token_ids": [record["tokens"] for record in records]}
    finally:
        for gateway in gateways:
            gateway.terminate()
        head.terminate()
        head.wait(timeout=120)


def main(out: str, variants: dict[str, str]) -> int:
    runs: dict[str, list[dict]] = {label: [] for label in variants}
    labels = list(variants)
    for round_ in range(ROUNDS):
        for label in labels if round_ % 2 == 0 else labels[::-1]:  # the order alternated
            runs[label].append(one_run(variants[label]))
            print(label, json.dumps({k: v for k, v in runs[label][-1].items() if k != "token_ids"}), flush=True)
    first = runs[labels[0]][0]["token_ids"]
    report = {"gateways": GATEWAYS, "requests_per_gateway": REQUESTS, "tokens": TOKENS, "stagger_s": STAGGER_S,
              "runs": runs, "same_tokens_everywhere": all(run["token_ids"] == first for r in runs.values()
                                                          for run in r),
              "median_seconds": {label: statistics.median(run["seconds"] for run in r) for label, r in runs.items()}}
    if len(labels) == 2:
        a, b = (report["median_seconds"][label] for label in labels)
        report[f"speedup_{labels[0]}_over_{labels[1]}"] = round(b / a, 3)
    for r in runs.values():
        for run in r:
            run["token_ids"] = [len(ids) for gateway in run["token_ids"] for ids in gateway]
    Path(out).write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], dict(arg.split("=", 1) for arg in sys.argv[2:])))
