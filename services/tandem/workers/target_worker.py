"""A target worker: the target model, verifying the draft blocks of every session routed to it in one forward.

The model stack is imported where the worker is built, not here (gateways import this module: see
workers.worker_base).
"""

from __future__ import annotations

from typing import Any

from tandem.core.protocol import VerifyRequest
from tandem.workers.worker_base import LoadedRunner, WorkerBase, WorkerConfig, WorkerReply, load_runner


class TargetWorker(WorkerBase):
    role = "target"

    def __init__(self, config: WorkerConfig, name: str = "target") -> None:
        super().__init__(name, config.batch_window_s, config.metrics_port)
        self._take(self.batcher.on_model_thread(load_runner, config))

    def _take(self, loaded: LoadedRunner, timed_formats: bool = True) -> None:
        """timed_formats: refuse a request whose format's masks take too long (core.format_masks), which only a
        worker that decides for itself may do: the ranks of a replica that each take the gateways' calls must refuse
        alike, and a time differs between them."""
        from tandem.core.format_masks import ROW_BUDGET_S, FormatMasks
        from tandem.core.formats import build_in_background
        from tandem.core.local import LocalVerifier

        formats = FormatMasks(loaded.tokenizer, loaded.eos_token_ids,
                              row_budget_s=ROW_BUDGET_S if timed_formats else None)
        build_in_background(loaded.tokenizer, loaded.eos_token_ids)  # its masks' tokenizer, before a request needs it
        self._hold(loaded)
        self.verifier = LocalVerifier(loaded.runner, formats)
        self._tokenizer = (loaded.tokenizer, loaded.eos_token_ids)

    def tokenizer(self) -> tuple[Any, frozenset[int]]:
        """The target's tokenizer and end-of-sequence ids, for the gateways: they tokenize with the model's own
        tokenizer without holding its files (unpickled, a tokenizer imports transformers' tokenization code, not
        torch)."""
        return self._tokenizer

    def verify(self, requests: list[VerifyRequest], trace: dict | None = None) -> WorkerReply:
        """`trace`: {sequence id: W3C carrier} for traced rows (see tandem.telemetry.worker)."""
        return self.telemetry.call("verify", requests, trace, lambda: self.batcher.submit(requests))

    def _run(self, requests: list[VerifyRequest]) -> WorkerReply:
        return self._serve(requests, self.verifier.verify, self.verifier.release)
