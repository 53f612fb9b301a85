"""A target worker: the target model, verifying the draft blocks of every session routed to it in one forward."""

from __future__ import annotations

from tandem.core.local import LocalVerifier
from tandem.core.protocol import KVCacheFull, StateLost, VerifyRequest
from tandem.workers.worker_base import WorkerBase, WorkerConfig, WorkerReply, load_runner


class TargetWorker(WorkerBase):
    role = "target"

    def __init__(self, config: WorkerConfig, name: str = "target") -> None:
        super().__init__(name, config.batch_window_s)
        self.runner = self.batcher.on_model_thread(load_runner, config)
        self.verifier = LocalVerifier(self.runner)

    def verify(self, requests: list[VerifyRequest], trace: dict | None = None) -> WorkerReply:
        """`trace`: {sequence id: W3C carrier} for traced rows (see tandem.telemetry.worker)."""
        return self.telemetry.call("verify", requests, trace, lambda: self.batcher.submit(requests))

    def _run(self, requests: list[VerifyRequest]) -> WorkerReply:
        try:
            return WorkerReply(results=self.verifier.verify(requests))
        except StateLost as lost:
            return WorkerReply(lost=lost.seq_ids)
        except KVCacheFull as full:
            return WorkerReply(full=(full.needed, full.capacity))
