"""One round's calls to a pool of Ray workers: group rows by worker, call in parallel, collect by a deadline; the
pool's KV usage, summed over its workers; and what both pool clients (draft pool, target replicas) share."""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field

import ray

from tandem.core.protocol import KVCacheFull, KVUsage, TraceCarriers, WorkerHealth, WorkerLoad
from tandem.errors import RequestRefused
from tandem.telemetry import tracing
from tandem.workers.pace import Pace
from tandem.workers.routing import AffinityRouter, routing_key, routing_tokens
from tandem.workers.tp_replica import TensorParallelReplica
from tandem.workers.worker_base import ray_failures

KV_USAGE_TIMEOUT_S = 2.0
# How long placing new sequences waits for workers to say how many they hold: a worker's threads answer at once,
# even mid-forward; one that does not is placed by what it said last.
LOAD_PROBE_TIMEOUT_S = 0.05


@dataclass(slots=True)
class FanoutResult:
    results: list  # per row; None where the worker failed, missed the deadline or no worker was healthy
    lost: list[str] = field(default_factory=list)  # sessions a worker no longer holds
    failed: int = 0
    timed_out: int = 0
    benched: list[int] = field(default_factory=list)  # workers that failed or missed the deadline this round
    full: KVCacheFull | None = None  # a worker's KV cache could not hold its rows (their results stay None)
    refused: RequestRefused | None = None  # one row's own request cannot go on (its worker's rows: results None)


class WireIds:
    """Sequence ids as workers see them: a gateway's own prefix (gateways sharing a pool may run equal request ids)
    and a count per use of an id. A worker runs calls on several threads, so a release may still be pending when a
    later request reuses the id; with its own wire id the late release cannot drop the new request's cache."""

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix
        self._wire: dict[str, str] = {}
        self._seq: dict[str, str] = {}
        self._uses = itertools.count()

    def to_wire(self, seq_id: str) -> str:
        wire = self._wire.get(seq_id)
        if wire is None:
            wire = self._wire[seq_id] = f"{self.prefix}{next(self._uses)}:{seq_id}"
            self._seq[wire] = seq_id
        return wire

    def from_wire(self, wire: str) -> str:
        return self._seq.get(wire, wire)

    def drop(self, seq_id: str) -> str | None:
        """The sequence ended: its wire id (None if no worker ever saw it), never used again."""
        wire = self._wire.pop(seq_id, None)
        self._seq.pop(wire, None)
        return wire


def fan_out(workers: list, router: AffinityRouter, ids: WireIds, method: str, requests: list, timeout_s: float,
            carriers: dict[str, dict[str, str]] | None = None, pace: Pace | None = None) -> FanoutResult:
    """`carriers`: W3C trace context per sequence id for the traced ones (tandem.telemetry.rounds); each worker gets
    those of its rows, and the spans it returns are exported here. `ids`: the sequence ids workers see. `pace`
    learns from every worker that answers in time."""
    out = FanoutResult(results=[None] * len(requests))
    if any(r.seq_id not in router.affinity for r in requests):
        hear_loads(workers, router)
    groups = router.group([(r.seq_id, routing_key(r), routing_tokens(r)) for r in requests])
    carriers = {ids.to_wire(seq_id): carrier for seq_id, carrier in carriers.items()} if carriers else carriers
    requests = [dataclasses.replace(r, seq_id=ids.to_wire(r.seq_id)) for r in requests]
    batches = {index: [requests[row] for row in rows] for index, rows in groups.items() if index is not None}
    sent = time.monotonic()
    futures = {index: _submit(workers[index], method, batch, carriers) for index, batch in batches.items()}
    deadline = sent + timeout_s
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
        if pace is not None:
            pace.observe(time.monotonic() - sent, batches[index])
        if reply.load is not None:
            router.observe(index, reply.load)
        if reply.spans:
            tracing.relay(reply.spans)
        if reply.lost:
            out.lost += [ids.from_wire(wire) for wire in reply.lost]
            continue
        if reply.full:
            out.full = KVCacheFull(*reply.full)
            if out.full.ahead:  # others fill it: its new rows try another worker (one they may have started freed)
                fresh = [requests[row].seq_id for row in groups[index] if not requests[row].keep]  # wire ids
                spilled = [ids.from_wire(wire) for wire in fresh]
                router.mark_full(index, spilled)
                if fresh:
                    workers[index].release.remote(fresh)
                for seq_id in spilled:  # its next call, wherever it goes, under a new wire id: this release, still
                    ids.drop(seq_id)    # in flight, cannot drop what that call starts (even back on this worker)
            continue
        if reply.refused:
            out.refused = RequestRefused(ids.from_wire(reply.refused[0]), reply.refused[1])
            continue
        for row, result in zip(groups[index], reply.results, strict=True):
            out.results[row] = result
    return out


def hear_loads(workers: list, router: AffinityRouter, timeout_s: float = LOAD_PROBE_TIMEOUT_S) -> None:
    """Ask the workers the router has not heard from lately what they hold (rank 0 of a tensor-parallel replica),
    waiting `timeout_s` at most: new sequences are then placed by every caller's load."""
    for index, load in answering(workers, router.unheard(), timeout_s).items():
        if load is not None:
            router.observe(index, load)


def answering(workers: list, indices: list[int], timeout_s: float) -> dict[int, WorkerLoad | None]:
    """Which of the workers at `indices` answer a load probe within `timeout_s` (rank 0 of a tensor-parallel
    replica), with what each said: a worker's threads answer at once, even mid-forward."""
    asked = {_first_rank(workers[i]).load.remote(): i for i in indices}
    if not asked:
        return {}
    ready, _ = ray.wait(list(asked), num_returns=len(asked), timeout=timeout_s)
    answers = {}
    for ref in ready:
        try:
            answers[asked[ref]] = ray.get(ref)
        except ray_failures():
            continue
    return answers


def _first_rank(worker):
    return worker.ranks[0] if isinstance(worker, TensorParallelReplica) else worker


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


def release(workers: list, router: AffinityRouter, ids: WireIds, seq_id: str, retain: bool = False) -> None:
    index = router.forget(seq_id, retain)
    wire = ids.drop(seq_id)
    if index is not None and wire is not None:
        workers[index].release.remote([wire], retain)


def kv_usage(workers: list, timeout_s: float = KV_USAGE_TIMEOUT_S) -> KVUsage:
    """The pool's KV tokens: every worker's info() figures summed. A tensor-parallel replica counts once, by rank 0
    (every rank holds its shard of the same sequences under the same budget). A worker that fails, or does not
    answer within `timeout_s` (dead, restarting, or busy with a long call: an actor serves one call at a time), is
    left out."""
    refs = [_first_rank(w).info.remote() for w in workers]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    total = KVUsage()
    for ref in ready:
        try:
            total += KVUsage.from_info(ray.get(ref))
        except ray_failures():
            continue
    return total


class RayPoolClient:
    """A gateway's view of a pool: its workers (in the order every gateway sees them), the router, and the prefix
    that keeps this gateway's sequence ids apart from other gateways' on shared workers. Implements the PoolSide
    part of the Drafter and Verifier protocols (core.protocol)."""

    timeout_s: float  # a call's deadline: timeout_s plus, per token it carries, per_token_s or less (deadline_s)
    per_token_s: float
    pace: Pace  # each pool sets all three

    def __init__(self, workers: list, router: AffinityRouter, prefix: str = "", ranks_per_worker: int = 1) -> None:
        """`ranks_per_worker`: a shared pool's tensor-parallel replica's ranks behind the rank 0 this client calls."""
        self.workers, self.router, self.ids = workers, router, WireIds(prefix)
        router.share(prefix)  # a prefix: other gateways or lanes call these workers too
        self.trace_carriers: TraceCarriers | None = None  # given by the gateway's engine loop (carry_trace)
        self._offered: tuple[list, list[str]] | None = None
        self.ranks_per_worker = ranks_per_worker
        # Shared pools that their manager no longer lists (stopped): no worker of theirs is coming back, so nothing
        # waits for one (set and cleared by the gateway's membership follower, engines.shared_pools).
        self.pools_gone = False
        self.waiting_since: float | None = None  # while a call waits for a worker to come back (monotonic)

    def deadline_s(self, requests: list) -> float:
        """A call's deadline: long enough for a slow worker's long prefill, short for a hung one (workers.pace)."""
        return self.timeout_s + self.pace.allowance(self.per_token_s) * sum(self.pace.count(r) for r in requests)

    def offer_workers(self, workers: list, names: list[str]) -> None:
        """The pool now has these workers (scaled): taken up at the next call, on the engine's thread."""
        self._offered = (list(workers), list(names))

    def _take_offer(self) -> None:
        offered, self._offered = self._offered, None
        if offered is not None and offered[1]:
            self.workers = offered[0]
            self.router.resize(offered[1])

    def actors(self) -> list:
        """Every actor behind the pool: each worker, or each rank of a tensor-parallel replica."""
        return [rank for w in self.workers for rank in (w.ranks if isinstance(w, TensorParallelReplica) else [w])]

    def release(self, seq_id: str, retain: bool = False) -> None:
        release(self.workers, self.router, self.ids, seq_id, retain)

    def kv_usage(self, timeout_s: float = KV_USAGE_TIMEOUT_S) -> KVUsage:
        """Summed over the workers that answer within `timeout_s` (remote calls: keep it off an event loop)."""
        return kv_usage(self.workers, timeout_s)

    def worker_health(self) -> list[WorkerHealth]:
        router = self.router
        return [WorkerHealth(name, router.healthy(i)) for i, name in enumerate(list(router.names))]

    def tensor_parallel(self) -> int:
        first = self.workers[0]
        return len(first.ranks) if isinstance(first, TensorParallelReplica) else self.ranks_per_worker

    def session_worker(self, session_id: str) -> str | None:
        index = self.router.sessions.get(session_id)
        names = self.router.names
        return names[index] if index is not None and index < len(names) else None

    def pin_session(self, session_id: str, worker: str) -> None:
        if session_id not in self.router.sessions and worker in self.router.names:
            self.router.pin(session_id, self.router.names.index(worker))

    def others_running(self, seq_id: str) -> int:
        return self.router.others_beside(seq_id)

    def waiting_for_worker(self) -> bool:
        return self.waiting_since is not None

    def carry_trace(self, carriers: TraceCarriers | None) -> None:
        self.trace_carriers = carriers

    def reachable(self, timeout_s: float) -> int:
        """Workers answering info() within `timeout_s`; a benched one that answers returns to service at once
        rather than after its cool-down (a tensor-parallel replica being rebuilt stays out until the rebuild ends)."""
        offered = self._offered  # workers the pool has now, not yet taken up (the engine thread does that)
        workers = list(offered[0] if offered is not None and offered[1] else self.workers)
        refs = [_first_rank(w).info.remote() for w in workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
        answered = 0
        for index, ref in enumerate(refs):
            if ref not in ready:
                continue
            try:
                ray.get(ref)
            except ray_failures():
                continue
            answered += 1
            if offered is None and index < self.router.size and self.router.benched_until[index] != float("inf"):
                self.router.benched_until[index] = 0.0
        return answered
