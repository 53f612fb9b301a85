"""Gateways sharing target replicas whose KV budgets are tight: how often is a new request sent where it cannot fit?

Tiny random-weight models (tandem.models.tiny, float32), an in-process Ray with two target replicas of KV_TOKENS each,
and GATEWAYS plain-decoding engines over them, each with its own wire-id prefix as a gateway over shared pools has.
The engines step in turn on one thread, so a run is the same sequence of calls every time; requests arrive at fixed
steps with prompts of mixed lengths (a third long). Per variant: calls a replica turned away because others' sequences
filled it (the router's `mark_full`), sequences freed for others (`evicted`), the steps from a request's arrival to
its first token (mean, p90, max), the steps until every request ended, wall seconds, and every request's tokens,
which must equal plain decoding alone (greedy, float32) in every variant. What it measures is placement, not speed:
the replicas share this machine's two cores.

Variants are the code on a PYTHONPATH each (this tree and a worktree of an older commit); each runs in a process of
its own, alternately, ROUNDS times:

    git worktree add /tmp/before f6d1497
    PYTHONPATH=services python docs/bench/kv-placement-v1.py docs/bench/kv-placement-v1.json \
        now=services before=/tmp/before/services

A round of the three gateways' steps took 30-40 ms on CPU-B, so the half second a gateway trusts a worker's word on
its load (routing.LOAD_FRESH_S) spans 10-15 rounds (on a GPU, by estimate, as many steps or more; on the real pair on
these CPUs one or two). `--load-fresh-s=0.02` sets it in every variant (all have it) to about one round.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GATEWAYS, REQUESTS, KV_TOKENS, ROUNDS = 3, 8, 256, 2
SEEDS = range(8)
SPACINGS = (6, 12)  # steps between a gateway's arrivals: the replicas mostly full, or often full
FRESH_ENV = "TANDEM_BENCH_LOAD_FRESH_S"


def workload(seed: int, spacing: int) -> list[dict]:
    """Per request: its gateway, arrival step, prompt and tokens; a third of the prompts long."""
    rng = random.Random(seed)
    requests = []
    for gateway in range(GATEWAYS):
        for n in range(REQUESTS):
            length = rng.randint(70, 110) if rng.random() < 1 / 3 else rng.randint(8, 24)
            requests.append({"id": f"g{gateway}-{n}", "gateway": gateway, "arrival": n * spacing + gateway,
                             "prompt": [rng.randrange(3, 290) for _ in range(length)],
                             "tokens": rng.randint(8, 24)})
    return requests


def one_run() -> list[dict]:
    """In this process (its PYTHONPATH the variant's code): every workload on the same two replicas, in turn."""
    import ray
    import torch

    from tandem.core.config import EngineConfig
    from tandem.engines.local import build_engine
    from tandem.models.loader import load_model
    from tandem.models.tiny import make_tiny
    from tandem.workers import routing
    from tandem.workers.target_pool import start_target_replicas
    from tandem.workers.worker_base import WorkerConfig

    if FRESH_ENV in os.environ:  # a worker's word kept as many steps as on a real model (see the docstring)
        routing.LOAD_FRESH_S = float(os.environ[FRESH_ENV])
    refused: list[int] = []
    mark_full = routing.AffinityRouter.mark_full
    routing.AffinityRouter.mark_full = lambda self, index, seq_ids: (refused.append(len(seq_ids)),
                                                                     mark_full(self, index, seq_ids))[1]
    dirs = make_tiny(Path(tempfile.mkdtemp(prefix="tandem-tiny-")), seed=0)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    replicas = start_target_replicas(WorkerConfig(model=str(dirs.target), dtype="float32", threads=1,
                                                  kv_tokens=KV_TOKENS), count=2)
    target = load_model(str(dirs.target), device=torch.device("cpu"), dtype=torch.float32, progress=False)
    local = build_engine(target, None, EngineConfig(calibrate=False))
    results = []
    for spacing in SPACINGS:
        for seed in SEEDS:
            _wait_idle(ray, replicas)
            evicted = _evicted(ray, replicas)
            del refused[:]
            result = _workload_run(replicas, local, workload(seed, spacing), f"s{spacing}-{seed}")
            results.append({"seed": seed, "spacing": spacing, **result, "refused_calls": len(refused),
                            "refused_rows": sum(refused), "evicted": _evicted(ray, replicas) - evicted})
    return results


def _wait_idle(ray, replicas: list) -> None:
    """Until the replicas hold no sequence (the last workload's releases are asynchronous)."""
    while any(ray.get([replica.cached_sequences.remote() for replica in replicas])):
        time.sleep(0.05)


def _evicted(ray, replicas: list) -> int:
    return sum(ray.get(replica.info.remote())["evicted"] for replica in replicas)


def _workload_run(replicas: list, local, requests: list[dict], name: str) -> dict:
    from tandem.core.config import EngineConfig, SamplingParams
    from tandem.core.engine import SpeculativeEngine
    from tandem.workers.target_pool import RayVerifier

    expected = {r["id"]: local.generate([r["prompt"]], _params(SamplingParams, r))[0].token_ids for r in requests}
    engines = [SpeculativeEngine(RayVerifier(replicas, prefix=f"{name}-gw{g}-"), None, EngineConfig(calibrate=False),
                                 local.eos_token_ids, local.decode) for g in range(GATEWAYS)]
    tokens: dict[str, list[int]] = {r["id"]: [] for r in requests}
    first: dict[str, int] = {}
    began, step = time.perf_counter(), 0
    while step < 5000 and (step <= requests[-1]["arrival"] or any(e.has_unfinished() for e in engines)):
        for r in requests:
            if r["arrival"] == step:
                engines[r["gateway"]].add_request(r["prompt"], _params(SamplingParams, r), r["id"])
        for engine in engines:
            for out in engine.step() if engine.has_unfinished() else ():
                tokens[out.request_id] += out.new_token_ids
                if out.new_token_ids:
                    first.setdefault(out.request_id, step)
        step += 1
    seconds = time.perf_counter() - began
    waits = sorted(first[r["id"]] - r["arrival"] for r in requests)
    return {"steps": step, "seconds": round(seconds, 2),
            "first_token_steps": {"mean": round(sum(waits) / len(waits), 2), "p90": waits[int(0.9 * len(waits))],
                                  "max": waits[-1]},
            "equal_to_alone": sum(tokens[r["id"]] == expected[r["id"]] for r in requests), "requests": len(requests)}


def _params(sampling_params, request: dict):
    return sampling_params(temperature=0.0, max_tokens=request["tokens"], ignore_eos=True)


def _summary(runs: dict[str, list[list[dict]]]) -> dict:
    """Per variant and spacing, over every seed and round: totals of refusals and evictions, means of the rest."""
    summary: dict = {}
    for label, rounds in runs.items():
        for spacing in SPACINGS:
            rows = [row for results in rounds for row in results if row["spacing"] == spacing]
            summary[f"{label} spacing {spacing}"] = {
                "runs": len(rows), "refused_calls": sum(r["refused_calls"] for r in rows),
                "refused_rows": sum(r["refused_rows"] for r in rows), "evicted": sum(r["evicted"] for r in rows),
                "first_token_steps_mean": round(sum(r["first_token_steps"]["mean"] for r in rows) / len(rows), 2),
                "first_token_steps_p90_mean": round(sum(r["first_token_steps"]["p90"] for r in rows) / len(rows), 2),
                "steps_mean": round(sum(r["steps"] for r in rows) / len(rows), 1),
                "equal_to_alone": f"{sum(r['equal_to_alone'] for r in rows)}/{sum(r['requests'] for r in rows)}"}
    return summary


def main(out: str, variants: dict[str, str], fresh_s: str = "") -> int:
    runs: dict[str, list[dict]] = {label: [] for label in variants}
    labels = list(variants)
    for round_ in range(ROUNDS):
        for label in labels if round_ % 2 == 0 else labels[::-1]:  # the order alternated
            env = os.environ | {"PYTHONPATH": str(Path(variants[label]).resolve())} | (
                {FRESH_ENV: fresh_s} if fresh_s else {})
            done = subprocess.run([sys.executable, __file__, "--one"], env=env, capture_output=True, text=True,
                                  timeout=1800)
            if done.returncode:
                raise SystemExit(f"{label}: {done.stderr[-3000:]}")
            runs[label].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(label, json.dumps(_summary({label: runs[label][-1:]})), flush=True)
    report = {"gateways": GATEWAYS, "requests_per_gateway": REQUESTS, "kv_tokens_per_replica": KV_TOKENS,
              "replicas": 2, "seeds": len(SEEDS), "load_fresh_s": float(fresh_s) if fresh_s else "the code's",
              "summary": _summary(runs), "runs": runs}
    print(json.dumps(report["summary"], indent=1))
    Path(out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--one"]:
        print(json.dumps(one_run()))
        sys.exit(0)
    fresh = [arg.split("=", 1)[1] for arg in sys.argv[2:] if arg.startswith("--load-fresh-s=")]
    sys.exit(main(sys.argv[1], dict(arg.split("=", 1) for arg in sys.argv[2:] if not arg.startswith("--")),
                  *fresh))
