"""Target replicas as a Verifier: each session verified on the replica holding its cache, replicas batching.

A replica that fails is benched and its sessions move to another replica, which is sent their history (the engine
resends it on StateLost); with no healthy replica the round fails with TargetUnavailable.
"""

from __future__ import annotations

import ray

from tandem.core.protocol import StateLost, VerifyRequest, VerifyResult
from tandem.workers.fanout import fan_out, release
from tandem.workers.routing import AffinityRouter
from tandem.workers.worker_base import start_workers


class TargetUnavailable(RuntimeError):
    """No target replica could verify these sequences."""


class RayVerifier:
    def __init__(self, replicas: list, timeout_s: float = 120.0, cooldown_s: float = 10.0) -> None:
        self.workers = replicas
        self.router = AffinityRouter(len(replicas), cooldown_s, "target")
        self.timeout_s = timeout_s
        self.vocab_size = ray.get(replicas[0].info.remote())["vocab_size"]

    def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        out = fan_out(self.workers, self.router, "verify", requests, self.timeout_s)
        unresolved = [r.seq_id for r, result in zip(requests, out.results, strict=True) if result is None]
        if unresolved and not any(self.router.healthy(i) for i in range(self.router.size)):
            raise TargetUnavailable(f"no healthy target replica for {len(unresolved)} sequence(s)")
        if unresolved or out.lost:
            raise StateLost(sorted(set(out.lost) | set(unresolved)))
        return out.results

    def release(self, seq_id: str) -> None:
        release(self.workers, self.router, seq_id)


def start_target_replicas(config, count: int, num_gpus: float = 0.0, num_cpus: float = 1.0) -> list:
    from tandem.workers.target_worker import TargetWorker

    return start_workers(TargetWorker, config, count, "target", num_gpus, num_cpus)
