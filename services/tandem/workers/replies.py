"""What a worker's call returns to its caller: one picklable reply, whatever happened to the call."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.core.protocol import WorkerLoad


@dataclass(slots=True)
class WorkerReply:
    """Either results, or the ids this worker no longer holds (it restarted, or never saw them), or that its KV
    cache is full (KVCacheFull's fields: needed and capacity tokens, others' sequences ahead), or that one row's own
    request cannot go on (RequestRefused's sequence id and message: the caller fails that request and sends the
    others again)."""

    results: list | None = None
    lost: list[str] | None = None
    full: tuple[int, int, bool] | None = None
    refused: tuple[str, str] | None = None
    spans: list[dict] | None = None  # finished spans of traced rows, for the gateway to export (telemetry.worker)
    load: WorkerLoad | None = None  # what the worker holds after the call, for every caller (routing.observe)
