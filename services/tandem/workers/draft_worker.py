"""A draft worker: one draft model and the draft caches of the sessions routed to it.

Plain Python so it can be tested in-process; `ray.remote(DraftWorker)` turns it into an actor. The model stack is
imported where the worker is built, not here (gateways import this module: see workers.worker_base).
"""

from __future__ import annotations

from tandem.core.protocol import DraftRequest
from tandem.workers.worker_base import WorkerBase, WorkerConfig, WorkerReply, load_runner


class DraftWorker(WorkerBase):
    role = "draft"

    def __init__(self, config: WorkerConfig, name: str = "draft") -> None:
        from tandem.core.format_masks import FormatMasks
        from tandem.core.formats import build_in_background
        from tandem.core.local import LocalDrafter

        super().__init__(name, config.batch_window_s, config.metrics_port)
        loaded = self.batcher.on_model_thread(load_runner, config, config.draft_vocab)
        self._hold(loaded)
        self.drafter = LocalDrafter(self.runner, top_m=config.top_m, confidence=config.confidence,
                                    formats=FormatMasks(loaded.tokenizer, loaded.eos_token_ids))
        build_in_background(loaded.tokenizer, loaded.eos_token_ids)  # its masks' tokenizer, before a request needs it

    def propose(self, requests: list[DraftRequest], trace: dict | None = None) -> WorkerReply:
        """`trace`: {sequence id: W3C carrier} for traced rows (see tandem.telemetry.worker)."""
        return self.telemetry.call("propose", requests, trace, lambda: self.batcher.submit(requests))

    def _run(self, requests: list[DraftRequest]) -> WorkerReply:
        return self._serve(requests, self.drafter.propose, self.drafter.release)
