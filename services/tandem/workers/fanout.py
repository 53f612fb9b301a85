"""One round's calls to a pool of Ray workers: group rows by worker, call in parallel, collect by a deadline; and
the pool's KV usage, summed over its workers."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import ray

from tandem.core.protocol import KVCacheFull, KVUsage
from tandem.telemetry import tracing
from tandem.workers.routing import AffinityRouter
from tandem.workers.tp_replica import TensorParallelReplica
from tandem.workers.worker_base import ray_failures

KV_USAGE_TIMEOUT_S = 2.0


@dataclass(slots=True)
class FanoutResult:
    results: list  # per row; None where the worker failed, missed the deadline or no worker was healthy
    lost: list[str] = field(default_factory=list)  # sessions a worker no longer holds
    failed: int = 0
    timed_out: int = 0
    benched: list[int] = field(default_factory=list)  # workers that failed or missed the deadline this round
    full: KVCacheFull | None = None  # a worker's KV cache could not hold its rows (their results stay None)


def fan_out(workers: list, router: AffinityRouter, method: str, requests: list, timeout_s: float,
            carriers: dict[str, dict[str, str]] | None = None) -> FanoutResult:
    """`carriers`: W3C trace context per sequence id for the traced ones (tandem.telemetry.rounds); each worker gets
    those of its rows, and the spans it returns are exported here."""
    out = FanoutResult(results=[None] * len(requests))
    groups = router.group([(r.seq_id, r.session) for r in requests])
    futures = {index: _submit(workers[index], method, [requests[row] for row in rows], carriers)
               for index, rows in groups.items() if index is not None}
    deadline = time.monotonic() + timeout_s
    for index, refs in futures.items():
        try:
            reply = _first_reply(refs, deadline)
        except ray.exceptions.GetTimeoutError:
            out.timed_out += 1
            out.benched.append(index)
            router.bench(index, "missed its deadline")
            continue
        except ray_failures() as exc:
            out.failed += 1
            out.benched.append(index)
            router.bench(index, f"failed ({type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]})")
            continue
        if reply.spans:
            tracing.relay(reply.spans)
        if reply.lost:
            out.lost += reply.lost
            continue
        if reply.full:
            out.full = KVCacheFull(*reply.full)
            continue
        for row, result in zip(groups[index], reply.results, strict=True):
            out.results[row] = result
    return out


def _submit(worker, method: str, batch: list, carriers: dict[str, dict[str, str]] | None) -> list:
    trace = {r.seq_id: carriers[r.seq_id] for r in batch if r.seq_id in carriers} if carriers else None
    args = (batch, trace) if trace else (batch,)
    if isinstance(worker, TensorParallelReplica):
        return worker.call(method, *args)
    return [getattr(worker, method).remote(*args)]


def _first_reply(refs: list, deadline: float):
    """The first reference's value; raises as soon as any of them fails (a dead rank of a tensor-parallel group
    leaves its peers waiting in a collective, so waiting for rank 0 alone would hang until the deadline)."""
    if len(refs) == 1:
        return ray.get(refs[0], timeout=max(0.0, deadline - time.monotonic()))
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise ray.exceptions.GetTimeoutError("deadline passed")
        ray.get(ready)  # raises the failure of a rank
    return ray.get(refs[0])


def release(workers: list, router: AffinityRouter, seq_id: str, retain: bool = False) -> None:
    index = router.forget(seq_id, retain)
    if index is not None:
        workers[index].release.remote([seq_id], retain)


def kv_usage(workers: list, timeout_s: float = KV_USAGE_TIMEOUT_S) -> KVUsage:
    """The pool's KV tokens: every worker's info() figures summed. A tensor-parallel replica counts once, by rank 0
    (every rank holds its shard of the same sequences under the same budget). A worker that fails, or does not
    answer within `timeout_s` (dead, restarting, or busy with a long call: an actor serves one call at a time), is
    left out."""
    refs = [(w.ranks[0] if isinstance(w, TensorParallelReplica) else w).info.remote() for w in workers]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    total = KVUsage()
    for ref in ready:
        try:
            total += KVUsage.from_info(ray.get(ref))
        except ray_failures():
            continue
    return total
