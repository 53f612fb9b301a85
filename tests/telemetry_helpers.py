"""Shared by the telemetry tests: in-memory tracing, and scraping a real /metrics endpoint."""

from __future__ import annotations

import contextlib
import urllib.request
from collections.abc import Iterator

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from tandem.telemetry import tracing


@contextlib.contextmanager
def in_memory_tracing() -> Iterator[tuple[InMemorySpanExporter, object]]:
    """Tracing on, into an in-memory exporter; yields (exporter, a tracer for the test's own client spans)."""
    exporter = InMemorySpanExporter()
    provider = tracing.install([SimpleSpanProcessor(exporter)], "tandem-gateway")
    try:
        yield exporter, provider.get_tracer("tests")
    finally:
        tracing.shutdown()


def scrape(url: str) -> dict[str, list[tuple[str, dict, float]]]:
    """Metric family name -> its samples (sample name, labels, value)."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {family.name: [(s.name, s.labels, s.value) for s in family.samples]
            for family in text_string_to_metric_families(text)}


def value(families: dict, sample: str, **labels) -> float:
    """The sum of a sample's values over the series matching `labels`."""
    family = next((f for f in families.values() if any(name == sample for name, _, _ in f)), [])
    return sum(v for name, ls, v in family if name == sample and all(ls.get(k) == str(x) for k, x in labels.items()))


def by_trace(spans: list[ReadableSpan], trace_id: int) -> list[ReadableSpan]:
    return [s for s in spans if s.context.trace_id == trace_id]
