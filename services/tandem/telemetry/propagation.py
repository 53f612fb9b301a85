"""W3C trace-context propagation (OTEL_PROPAGATORS; default tracecontext,baggage): gRPC metadata and Ray carriers.

API-only (no SDK import), so the client stays light.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from opentelemetry import propagate, trace
from opentelemetry.context import Context


def extract_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context:
    """The trace context a client sent in its gRPC metadata (traceparent, tracestate, baggage)."""
    carrier = {key: value for key, value in metadata or () if isinstance(value, str)}
    return propagate.extract(carrier)


def outgoing_metadata() -> list[tuple[str, str]] | None:
    """The current trace context as gRPC metadata, or None when no span is active (the common, free case)."""
    if not trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return list(carrier.items()) or None


def carrier_for(span: trace.Span) -> dict[str, str]:
    """A W3C carrier (a small dict that pickles into a Ray call) for `span` as the parent."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def context_from(carrier: Mapping[str, str]) -> Context:
    return propagate.extract(carrier)
