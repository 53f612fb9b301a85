"""Target replicas as a Verifier: each session verified on the replica holding its cache, replicas batching.

A replica that fails or misses the deadline is benched and its sessions move to another replica, which is sent their
history (the engine resends it on StateLost). The deadline grows with the tokens a call carries: it is there to catch
a hung replica, not a slow one (16 prompts' prefill in bf16 on one AVX2 core takes minutes). A tensor-parallel replica
that fails (one dead rank breaks the whole group) is rebuilt in the background and returns to service when its model
is loaded. With no healthy replica, the round waits for a rebuild in progress (up to `rebuild_timeout_s`), or for a
replica to answer again (`restart_wait_s`: Ray restarts a dead actor, which loads its model again), else fails with
TargetUnavailable.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import ray

from tandem.core.config import TARGET_TOKEN_ALLOWANCE_S
from tandem.core.protocol import StateLost, VerifyRequest, VerifyResult
from tandem.core.row_layout import RowLayout
from tandem.errors import BackendUnavailable
from tandem.workers.fanout import RayPoolClient, fan_out
from tandem.workers.pace import Pace
from tandem.workers.routing import AffinityRouter
from tandem.workers.tp_replica import TensorParallelReplica
from tandem.workers.worker_base import start_workers

log = logging.getLogger(__name__)
TOKENIZER_TIMEOUT_S = 60.0  # how long one target replica may take to hand over its tokenizer
PER_TOKEN_S = TARGET_TOKEN_ALLOWANCE_S  # a verify call's per token it carries (prompt, resent history, drafts)
# How long a round with no replica left waits for one to answer again: a dead single-rank replica is restarted by Ray
# and loads its model (seconds for a small model); kept well below a gateway's stall timeout (60 s by default), past
# which the step would fail every request anyway.
RESTART_WAIT_S = 30.0
RESTART_POLL_S = 0.5


class TargetUnavailable(BackendUnavailable):
    """No target replica could verify these sequences."""


class RayVerifier(RayPoolClient):
    def __init__(self, replicas: list, timeout_s: float = 120.0, cooldown_s: float = 10.0,
                 rebuild_timeout_s: float = 600.0, names: list[str] | None = None, prefix: str = "",
                 tensor_parallel: int = 1, per_token_s: float = PER_TOKEN_S,
                 restart_wait_s: float = RESTART_WAIT_S) -> None:
        """A call's deadline: `timeout_s` plus `per_token_s` for each token it carries. `tensor_parallel`: ranks
        behind each replica a shared pool's rank 0 leads (replicas given here as TensorParallelReplica count their
        own ranks)."""
        super().__init__(replicas, AffinityRouter(len(replicas), cooldown_s, "target", names=names), prefix,
                         ranks_per_worker=tensor_parallel)
        self.timeout_s, self.per_token_s, self.rebuild_timeout_s = timeout_s, per_token_s, rebuild_timeout_s
        self.restart_wait_s = restart_wait_s
        self._waited = False  # a wait for a replica to answer found none: later rounds fail at once until one does
        self.pace = Pace(_tokens)
        info = ray.get(replicas[0].info.remote())
        self.vocab_size, self.context_window = info["vocab_size"], info.get("context_window")
        self.row_layout = RowLayout.from_info(info)
        self.rebuilds: dict[int, Future] = {}
        self.rebuilt = 0
        self._executor = ThreadPoolExecutor(max_workers=len(replicas), thread_name_prefix="tandem-rebuild")

    def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        self._take_offer()
        out = fan_out(self.workers, self.router, self.ids, "verify", requests, self.deadline_s(requests),
                      self.trace_carriers, self.pace)
        if any(result is not None for result in out.results):
            self._waited = False  # a replica serves again: the next outage is waited out once more
        for index in out.benched:
            self._rebuild(index)
        if out.full is not None:
            raise out.full
        if out.refused is not None:
            raise out.refused
        unresolved = [r.seq_id for r, result in zip(requests, out.results, strict=True) if result is None]
        if unresolved and not self._any_healthy(restarting=out.failed > 0):
            raise TargetUnavailable(f"no healthy target replica for {len(unresolved)} sequence(s)")
        if unresolved or out.lost:
            raise StateLost(sorted(set(out.lost) | set(unresolved)))
        return out.results

    def _any_healthy(self, restarting: bool = False) -> bool:
        """Whether a replica can take rows: waiting for a rebuild in progress, or, where a replica failed (died:
        `restarting`), for one to answer again; a replica that missed its deadline (hung) is not waited for."""
        if any(self.router.healthy(i) for i in range(self.router.size)):
            return True
        pending = [f for f in self.rebuilds.values() if not f.done()]
        if pending:
            log.warning("no healthy target replica: waiting for %d rebuild(s)", len(pending))
            self.waiting_since = time.monotonic()
            try:
                wait(pending, timeout=self.rebuild_timeout_s)
            finally:
                self.waiting_since = None
        elif restarting and self.restart_wait_s > 0 and not self._waited and not self.pools_gone:
            # Resumed once Ray restarts it; meanwhile the gateway's readiness says NOT_SERVING (waiting_since), and
            # pools stopped meanwhile end the wait: their workers are not coming back.
            log.warning("no healthy target replica: waiting up to %.0f s for one to answer", self.restart_wait_s)
            deadline, answered = time.monotonic() + self.restart_wait_s, 0
            self.waiting_since = time.monotonic()
            try:
                while ((left := deadline - time.monotonic()) > 0 and not self.pools_gone
                       and not (answered := self.reachable(min(2.0, left)))):
                    time.sleep(min(RESTART_POLL_S, max(0.0, deadline - time.monotonic())))
            finally:
                self.waiting_since = None
            # Only an answer counts: a cool-down that ran out meanwhile says nothing of a worker killed for good.
            self._waited = not answered  # none came back: later rounds fail at once until one answers
            return answered > 0
        return any(self.router.healthy(i) for i in range(self.router.size))

    def _rebuild(self, index: int) -> None:
        replica, running = self.workers[index], self.rebuilds.get(index)
        if not isinstance(replica, TensorParallelReplica) or (running is not None and not running.done()):
            return
        self.router.benched_until[index] = float("inf")  # out of service until the rebuild finishes

        def rebuild() -> None:
            log.warning("target replica %d: rebuilding its tensor-parallel group", index)
            try:
                replica.rebuild()
            except Exception:
                log.exception("target replica %d: rebuild failed; retrying after the cool-down", index)
                self.router.bench(index, "could not be rebuilt")
                return
            self.rebuilt += 1
            self.router.benched_until[index] = 0.0
            log.warning("target replica %d: rebuilt", index)

        self.rebuilds[index] = self._executor.submit(rebuild)


def _tokens(request: VerifyRequest) -> int:
    """Tokens a verify call's forward runs for this row: its uncached ones (capped by its prefill limit) and drafts."""
    append = min(len(request.append), request.prefill_limit) if request.prefill_limit else len(request.append)
    return append + (len(request.draft.tokens) if request.draft else 0)


def start_target_replicas(config, count: int, num_gpus: float = 0.0, num_cpus: float = 1.0,
                          resources: dict[str, float] | None = None, **naming) -> list:
    """`naming`: start_workers' `first` and `detached_prefix` (shared pools)."""
    from tandem.workers.target_worker import TargetWorker

    return start_workers(TargetWorker, config, count, "target", num_gpus, num_cpus, resources, **naming)


def target_tokenizer(replicas: list, where: str) -> tuple[Any, frozenset[int]]:
    """The target's tokenizer and end-of-sequence ids (`TargetWorker.tokenizer`), from the first replica that
    answers: the process that serves needs no model files of its own, nor the model stack (unpickled, a tokenizer
    imports transformers' tokenization code alone). `where` names the pools in the error."""
    for replica in replicas:
        try:
            return ray.get(replica.tokenizer.remote(), timeout=TOKENIZER_TIMEOUT_S)
        except ray.exceptions.RayError as exc:  # died, restarting, or timed out
            log.warning("%s: a target replica did not hand over its tokenizer: %s", where, exc)
    raise TargetUnavailable(f"{where}: no target replica handed over its tokenizer (of {len(replicas)})")
