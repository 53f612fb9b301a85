"""The draft-worker pool as a Drafter: sessions routed to Ray actors, failures isolated.

A draft worker that dies, errors or misses the deadline is benched; its sessions get empty proposals this round (a
plain-decoding round, invisible to clients) and move to another worker, which is sent their history. The deadline
grows with the tokens a call must first catch up on (prompts, tokens decoded while not drafting). A worker whose KV
cache is full gives its rows empty proposals too, but stays in service.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.core.protocol import DraftProposal, DraftRequest, StateLost
from tandem.workers.fanout import RayPoolClient, answering, fan_out
from tandem.workers.pace import Pace
from tandem.workers.routing import AffinityRouter
from tandem.workers.worker_base import start_workers

# Seconds a draft call may take per token it must first catch up on, beyond timeout_s, until the pool shows a faster
# pace (workers.pace): enough for the slowest prefill measured (the 0.5B draft in bf16 on one AVX2 core without bf16
# FMA, 0.12 s a token), so that a slow worker still drafts after long prompts; a round's drafts carry a token or a
# few, whose deadline stays near timeout_s.
PER_TOKEN_S = 0.15
# A benched draft worker answers a load probe within this, once its cool-down is over, before it is given rows again.
REJOIN_PROBE_S = 1.0


@dataclass(slots=True)
class PoolStats:
    calls: int = 0
    failures: int = 0
    timeouts: int = 0


class RayDrafter(RayPoolClient):
    def __init__(self, workers: list, timeout_s: float = 5.0, cooldown_s: float = 10.0,
                 per_token_s: float = PER_TOKEN_S, names: list[str] | None = None, prefix: str = "") -> None:
        super().__init__(workers, AffinityRouter(len(workers), cooldown_s, "draft", names=names), prefix)
        self.timeout_s, self.per_token_s = timeout_s, per_token_s
        self.pace = Pace(_catch_up_tokens)
        self.stats = PoolStats()

    @property
    def affinity(self) -> dict[str, int]:
        return self.router.affinity

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        self._take_offer()
        self._probe_benched()
        out = fan_out(self.workers, self.router, self.ids, "propose", requests, self.deadline_s(requests),
                      self.trace_carriers, self.pace)
        self.router.probe_first.update(self.router.names[index] for index in out.benched)
        self.stats.calls += 1
        self.stats.failures += out.failed
        self.stats.timeouts += out.timed_out
        if out.refused is not None:
            raise out.refused
        if out.lost:
            raise StateLost(out.lost)
        return [result or DraftProposal(tokens=[], failed=True) for result in out.results]

    def _probe_benched(self) -> None:
        """A benched worker whose cool-down is over must answer a probe before it is given rows again. Its first
        call back carries every history its sessions must resend, so its deadline is long (5 s + 0.15 s a token):
        given to a worker still stalled (a stopped process, a hung forward), it held the engine's step past its
        stall timeout, which failed every request; one that does not answer stays benched, its sessions plain. The
        router routes to none of them until it answers (AffinityRouter.probe_first), so a cool-down ending between
        this probe and the round's routing gives it no rows."""
        router = self.router
        due = [i for i, name in enumerate(router.names) if name in router.probe_first and router.healthy(i)]
        answered = answering(self.workers, due, REJOIN_PROBE_S)
        for index in due:
            if index in answered:
                router.probe_first.discard(router.names[index])
            else:
                router.bench(index, "did not answer a probe after its cool-down")


def _catch_up_tokens(request: DraftRequest) -> int:
    return len(request.append)


def start_draft_workers(config, count: int, num_gpus: float = 0.0, num_cpus: float = 1.0,
                        resources: dict[str, float] | None = None, **naming) -> list:
    """`naming`: start_workers' `first` and `detached_prefix` (shared pools)."""
    from tandem.workers.draft_worker import DraftWorker

    return start_workers(DraftWorker, config, count, "draft", num_gpus, num_cpus, resources, **naming)
