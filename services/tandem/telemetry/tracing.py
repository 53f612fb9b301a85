"""Tracing: a tracer provider from the standard OTEL_* variables, and the worker-span relay.

On when OTEL_TRACES_EXPORTER names exporters (otlp, console, ... any `opentelemetry_traces_exporter` entry point), or
when it is unset and an OTLP endpoint is set (OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT). Off
when OTEL_SDK_DISABLED=true, OTEL_TRACES_EXPORTER=none, or nothing is configured (unlike the SDK's default of
"otlp", a server nobody pointed at a collector should not retry localhost:4317 forever). The exporters, batch
processor, sampler, resource and propagators then read their own variables (OTEL_EXPORTER_OTLP_*, OTEL_BSP_*,
OTEL_TRACES_SAMPLER[_ARG], OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_PROPAGATORS).

While off, `enabled()` is False and instrumented code creates no spans at all: every caller checks it first.

Worker spans reach the exporter in one of two ways (see `worker.py`): a worker whose own environment configures an
exporter exports directly (OTLP to the collector, the usual deployment); otherwise it returns its finished spans
with the reply, and the gateway's pipeline exports them (`relay`) under the worker's own resource.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor, SynchronousMultiSpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from tandem.errors import InvalidArgument
from tandem.telemetry.propagation import carrier_for, context_from, extract_metadata, outgoing_metadata

__all__ = ["carrier_for", "context_from", "decode_span", "enabled", "encode_spans", "extract_metadata", "install",
           "outgoing_metadata", "relay", "setup_from_env", "shutdown", "tracer"]

log = logging.getLogger(__name__)

TRACER_NAME = "tandem"
OTLP_PROTOCOLS = {"grpc": "otlp_proto_grpc", "http/protobuf": "otlp_proto_http"}


@dataclass(slots=True)
class _Tracing:
    provider: TracerProvider
    tracer: trace.Tracer
    processor: SpanProcessor  # where relayed worker spans go too


_state: _Tracing | None = None


def enabled() -> bool:
    return _state is not None


def tracer() -> trace.Tracer:
    """The gateway's tracer; only valid while `enabled()`."""
    return _state.tracer


def provider() -> TracerProvider | None:
    """The gateway's tracer provider while `enabled()`, else None."""
    return _state.provider if _state is not None else None


def sdk_disabled() -> bool:
    return os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def exporter_names() -> list[str]:
    """The trace exporters the environment asks for ([] = tracing off)."""
    if sdk_disabled():
        return []
    names = [n.strip().lower() for n in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if not names:
        endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        names = ["otlp"] if endpoint else []
    return [] if "none" in names else names


def exporters_from_env() -> list[SpanExporter]:
    """Instantiate the exporters named by the environment through their `opentelemetry_traces_exporter` entry points;
    "otlp" picks the transport from OTEL_EXPORTER_OTLP_TRACES_PROTOCOL / OTEL_EXPORTER_OTLP_PROTOCOL (default grpc)."""
    from importlib.metadata import entry_points

    exporters = []
    for name in exporter_names():
        if name == "otlp":
            protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip()
            name = OTLP_PROTOCOLS.get(protocol, name)
        found = list(entry_points(group="opentelemetry_traces_exporter", name=name))
        if not found:
            raise InvalidArgument(f"OTEL_TRACES_EXPORTER: no trace exporter named {name!r} is installed")
        exporters.append(found[0].load()())
    return exporters


def resource_for(service_name: str, **attributes) -> Resource:
    """OTEL_RESOURCE_ATTRIBUTES / OTEL_SERVICE_NAME, defaulting service.name to `service_name`."""
    named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    return Resource.create(({} if named else {"service.name": service_name}) | attributes)


def install(processors: Sequence[SpanProcessor], service_name: str = "tandem-gateway",
            set_global: bool = False) -> TracerProvider:
    """Turn tracing on with these span processors (tests pass SimpleSpanProcessor(InMemorySpanExporter()))."""
    global _state
    shutdown()
    provider = TracerProvider(resource=resource_for(service_name))
    processor = SynchronousMultiSpanProcessor()
    for p in processors:
        processor.add_span_processor(p)
    provider.add_span_processor(processor)
    if set_global:
        trace.set_tracer_provider(provider)
    _state = _Tracing(provider, provider.get_tracer(TRACER_NAME), processor)
    return provider


def setup_from_env(service_name: str = "tandem-gateway") -> list[str]:
    """Configure tracing from the environment (and make it the global provider); returns the exporters' names."""
    exporters = exporters_from_env()
    if exporters:
        install([BatchSpanProcessor(e) for e in exporters], service_name, set_global=True)
    return exporter_names() if exporters else []


def shutdown() -> None:
    """Flush and turn tracing off."""
    global _state
    state, _state = _state, None
    if state is not None:
        state.provider.shutdown()


# -- worker-span relay ----------------------------------------------------------------------------------------------


def encode_spans(spans: Iterable[ReadableSpan]) -> list[dict]:
    """Finished spans as plain data for a Ray reply."""
    out = []
    for span in spans:
        ctx, parent = span.context, span.parent
        out.append({
            "name": span.name, "trace_id": ctx.trace_id, "span_id": ctx.span_id, "flags": int(ctx.trace_flags),
            "parent_id": parent.span_id if parent is not None else None, "kind": span.kind.value,
            "start": span.start_time, "end": span.end_time, "attributes": dict(span.attributes or {}),
            "status": (span.status.status_code.value, span.status.description),
            "events": [(e.name, e.timestamp, dict(e.attributes or {})) for e in span.events],
            "resource": dict(span.resource.attributes),
            "scope": span.instrumentation_scope.name if span.instrumentation_scope else TRACER_NAME,
        })
    return out


def decode_span(data: dict) -> ReadableSpan:
    flags = TraceFlags(data["flags"])
    context = SpanContext(data["trace_id"], data["span_id"], is_remote=False, trace_flags=flags)
    parent = (SpanContext(data["trace_id"], data["parent_id"], is_remote=True, trace_flags=flags)
              if data["parent_id"] is not None else None)
    code, description = data["status"]
    return ReadableSpan(
        data["name"], context=context, parent=parent, resource=Resource(data["resource"]),
        attributes=data["attributes"], events=[Event(n, a, t) for n, t, a in data["events"]],
        kind=SpanKind(data["kind"]), status=Status(StatusCode(code), description), start_time=data["start"],
        end_time=data["end"], instrumentation_scope=InstrumentationScope(data["scope"]))


def relay(spans: list[dict]) -> None:
    """Export spans a worker returned through this process's pipeline (dropped while tracing is off)."""
    state = _state
    if state is None:
        return
    for data in spans:
        try:
            state.processor.on_end(decode_span(data))
        except Exception:  # a malformed span must not fail the round it rode on
            log.warning("dropped a worker span that could not be decoded", exc_info=True)
