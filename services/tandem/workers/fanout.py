"""One round's calls to a pool of Ray workers: group rows by worker, call in parallel, collect by a deadline."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import ray

from tandem.workers.routing import AffinityRouter
from tandem.workers.worker_base import ray_failures


@dataclass(slots=True)
class FanoutResult:
    results: list  # per row; None where the worker failed, missed the deadline or no worker was healthy
    lost: list[str] = field(default_factory=list)  # sessions a worker no longer holds
    failed: int = 0
    timed_out: int = 0


def fan_out(workers: list, router: AffinityRouter, method: str, requests: list, timeout_s: float) -> FanoutResult:
    out = FanoutResult(results=[None] * len(requests))
    groups = router.group([r.seq_id for r in requests])
    futures = {index: getattr(workers[index], method).remote([requests[row] for row in rows])
               for index, rows in groups.items() if index is not None}
    deadline = time.monotonic() + timeout_s
    for index, future in futures.items():
        try:
            reply = ray.get(future, timeout=max(0.0, deadline - time.monotonic()))
        except ray.exceptions.GetTimeoutError:
            out.timed_out += 1
            router.bench(index, "missed its deadline")
            continue
        except ray_failures() as exc:
            out.failed += 1
            router.bench(index, f"failed ({type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]})")
            continue
        if reply.lost:
            out.lost += reply.lost
            continue
        for row, result in zip(groups[index], reply.results, strict=True):
            out.results[row] = result
    return out


def release(workers: list, router: AffinityRouter, seq_id: str) -> None:
    index = router.forget(seq_id)
    if index is not None:
        workers[index].release.remote([seq_id])
