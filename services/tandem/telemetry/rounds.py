"""Per-request child spans for the engine's rounds, kept on the engine thread (gateway/engine_thread.py).

Before each engine step, every traced request without an open round span gets one ("tandem.prefill" for its first
round, "tandem.spec.round" after) and its W3C carrier goes into `carriers`, which the worker pools read to parent the
workers' spans. After the step, the request's StepOutput closes the span with what the round did, read from the
sequence's RequestStats and policy: k drafted, accepted, fallback state. A request outside this step's batch keeps
its span open until it is stepped. TANDEM_TRACE_ROUNDS=0 keeps only the request span (worker spans then hang off it).

Only requests whose span is recording are tracked; with tracing off nothing here runs (`active` stays False).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from opentelemetry import trace

from tandem.telemetry import tracing

if TYPE_CHECKING:
    from tandem.core.requests import Sequence
    from tandem.core.stats import RequestStats


def _counts(stats: RequestStats) -> tuple[int, int, int, int]:
    return stats.rounds, stats.drafted, stats.accepted, stats.draft_failures


@dataclass(slots=True)
class _Traced:
    request_span: trace.Span
    seq: Sequence
    carrier: dict[str, str]  # the request span's, for workers when rounds are not spans
    round_span: trace.Span | None = None
    index: int = 0
    counts: tuple[int, int, int, int] = (0, 0, 0, 0)


class RoundTracer:
    def __init__(self, round_spans: bool | None = None) -> None:
        if round_spans is None:
            round_spans = os.environ.get("TANDEM_TRACE_ROUNDS", "1").strip().lower() not in ("0", "false", "off")
        self.round_spans = round_spans
        self.carriers: dict[str, dict[str, str]] = {}  # request id -> carrier of its current parent for workers
        self._traced: dict[str, _Traced] = {}

    @property
    def active(self) -> bool:
        return bool(self._traced)

    def add(self, request_id: str, span: trace.Span, seq: Sequence) -> None:
        if not span.is_recording():
            return
        carrier = tracing.carrier_for(span)
        self._traced[request_id] = _Traced(span, seq, carrier)
        if not self.round_spans:
            self.carriers[request_id] = carrier

    def before_step(self) -> None:
        if not self.round_spans or not tracing.enabled():
            return
        tracer = tracing.tracer()
        for request_id, traced in self._traced.items():
            if traced.round_span is None:
                name = "tandem.prefill" if traced.index == 0 else "tandem.spec.round"
                parent = trace.set_span_in_context(traced.request_span)
                traced.round_span = tracer.start_span(name, context=parent)
                traced.counts = _counts(traced.seq.stats)
                self.carriers[request_id] = tracing.carrier_for(traced.round_span)

    def on_output(self, request_id: str, new_tokens: int, finish_reason: str | None) -> None:
        traced = self._traced.get(request_id)
        if traced is None:
            return
        if (span := traced.round_span) is not None:
            rounds, drafted, accepted, failures = (now - before for now, before in
                                                   zip(_counts(traced.seq.stats), traced.counts, strict=True))
            attributes = {"tandem.spec.round": traced.index, "tandem.spec.k": drafted, "tandem.spec.accepted": accepted,
                          "tandem.spec.fallback": traced.seq.policy.fallback, "tandem.tokens.emitted": new_tokens}
            if traced.index == 0:
                attributes["tandem.tokens.prompt"] = len(traced.seq.prompt)
            if failures:
                attributes["tandem.draft.failed"] = True
            if finish_reason is not None:
                attributes["tandem.finish_reason"] = finish_reason
            span.set_attributes(attributes)
            span.end()
            traced.round_span = None
            traced.index += max(rounds, 1)
            if self.round_spans:
                self.carriers.pop(request_id, None)
        if finish_reason is not None:
            self.forget(request_id)

    def forget(self, request_id: str, error: Exception | None = None) -> None:
        traced = self._traced.pop(request_id, None)
        self.carriers.pop(request_id, None)
        if traced is not None and traced.round_span is not None:
            if error is not None:
                traced.round_span.set_status(trace.Status(trace.StatusCode.ERROR, str(error)))
                traced.round_span.set_attribute("error.type", type(error).__name__)
            traced.round_span.end()

    def fail_all(self, error: Exception) -> None:
        for request_id in list(self._traced):
            self.forget(request_id, error)
