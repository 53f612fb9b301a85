"""Worker-side telemetry: spans for traced calls, and the worker's own Prometheus endpoint.

A pool call carries `trace`, {sequence id: W3C carrier} for the rows whose requests are traced (None when none
are). After the call the worker records one span per distinct parent, "tandem.draft.propose" or
"tandem.target.verify" (kind SERVER), covering the whole batched call, with what it did for that parent's rows.

Export: when the worker's own environment configures trace exporters (OTEL_EXPORTER_OTLP_ENDPOINT,
OTEL_TRACES_EXPORTER, ... read as in `tracing`), its spans go there directly. Otherwise they ride back with the
reply (WorkerReply.spans) and the gateway exports them through its pipeline (`tracing.relay`), keeping the worker's
resource (service.name tandem-draft-worker / tandem-target-worker). OTEL_SDK_DISABLED=true records nothing.

Metrics: with TANDEM_WORKER_METRICS_PORT set in the worker's environment (`tandem serve --worker-metrics-port`
sets it for a local Ray cluster, and TANDEM_WORKER_METRICS_HOST to its --host), the worker serves /metrics on that
port or, when taken (several workers on one node), on one of the next 31 ports or any free one; `info()["metrics"]`
says where. Besides the call counters it
carries the gauge tandem.worker.kv_tokens, read at scrape time from the worker's model runner, by tandem.kv.state:
used (tokens held by running sequences and retained sessions), reserved (slots x capacity), capacity (the budget).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from tandem.core.protocol import KVUsage
from tandem.telemetry import tracing
from tandem.telemetry.endpoint import Endpoint, _gauge
from tandem.telemetry.metrics import TIME_TO_FIRST_TOKEN_BUCKETS, kv_observations, observe_shared_tokens

log = logging.getLogger(__name__)

METRICS_PORT_ENV = "TANDEM_WORKER_METRICS_PORT"
# The address /metrics listens on (unset: the Ray node's, for a cluster's Prometheus): `tandem serve`'s own local Ray
# sets the gateway's --host, loopback unless the operator opened it.
METRICS_HOST_ENV = "TANDEM_WORKER_METRICS_HOST"
DEFAULT_WORKER_METRICS_PORT = 9465
PORT_TRIES = 32
SPAN_NAMES = {"propose": "tandem.draft.propose", "verify": "tandem.target.verify"}


class _Collector(SpanProcessor):
    """Keeps finished spans until the reply takes them."""

    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []
        self._lock = threading.Lock()

    def on_end(self, span: ReadableSpan) -> None:
        with self._lock:
            self.spans.append(span)

    def drain(self) -> list[ReadableSpan]:
        with self._lock:
            spans, self.spans = self.spans, []
        return spans


def _row_attributes(method: str, requests: Sequence, results: Sequence | None) -> dict:
    attributes = {"tandem.batch.rows": len(requests), "tandem.tokens.appended": sum(len(r.append) for r in requests)}
    if method == "propose":
        attributes["tandem.spec.k"] = sum(r.k for r in requests)
        if results is not None:
            attributes["tandem.spec.drafted"] = sum(len(p.tokens) for p in results)
    elif method == "verify":
        attributes["tandem.spec.k"] = sum(len(r.draft.tokens) if r.draft else 0 for r in requests)
        if results is not None:
            attributes["tandem.spec.accepted"] = sum(v.accepted for v in results)
    return attributes


ROLE_METHODS = {"draft": "propose", "target": "verify"}  # the call each role's workers serve


class WorkerMetrics:
    def __init__(self, role: str, name: str, host: str, port: int,
                 kv_usage: Callable[[], KVUsage | None] | None = None) -> None:
        """`kv_usage`: the worker's KV usage, None while its model is loading (read at scrape time)."""
        ports = [port] if port == 0 else [*range(port, port + PORT_TRIES), 0]
        self.endpoint = Endpoint(f"tandem-{role}-worker", host, ports)
        meter = self.endpoint.meter
        self.base = {"tandem.worker.role": role, "tandem.worker.name": name}
        self.calls = meter.create_counter("tandem.worker.calls", unit="{call}", description="Calls served, by method.")
        self.rows = meter.create_counter("tandem.worker.rows", unit="{sequence}", description="Sequence rows served.")
        self.appended = meter.create_counter("tandem.worker.appended_tokens", unit="{token}",
                                             description="Committed tokens fed to the model (prefill, catch-up).")
        self.lost = meter.create_counter("tandem.worker.state_lost", unit="{call}",
                                         description="Calls answered with lost sequences (resent by the gateway).")
        self.evicted = meter.create_counter("tandem.worker.kv_evictions", unit="{sequence}",
                                            description="Sequences whose caches were freed for a call of another "
                                            "gateway or lane that came before them (priority, then arrival).")
        # At 0 from the start (absent series read as no data to an alert): each role's one method.
        self.lost.add(0, self.base | {"tandem.worker.method": ROLE_METHODS.get(role, role)})
        self.evicted.add(0, self.base)
        self.duration = meter.create_histogram("tandem.worker.call.duration", unit="s",
                                               description="Time to serve one batched call.",
                                               explicit_bucket_boundaries_advisory=TIME_TO_FIRST_TOKEN_BUCKETS)
        self._kv_usage = kv_usage
        meter.create_observable_gauge("tandem.worker.kv_tokens", _gauge(self._kv_tokens), unit="{token}",
                                      description="KV cache tokens of this worker's model, by state: used (held by "
                                      "running sequences and retained sessions), reserved (slots x capacity), "
                                      "capacity (the budget).")
        observe_shared_tokens(meter, self._shared_tokens, "this worker's model")

    def _shared_tokens(self) -> Iterator[tuple[float, dict]]:
        usage = self._kv_usage() if self._kv_usage is not None else None
        if usage is not None:
            yield usage.shared, self.base

    def _kv_tokens(self) -> Iterator[tuple[float, dict]]:
        usage = self._kv_usage() if self._kv_usage is not None else None
        if usage is not None:
            yield from kv_observations(usage, self.base)

    def record(self, method: str, requests: Sequence, seconds: float, lost: bool) -> None:
        attributes = self.base | {"tandem.worker.method": method}
        self.calls.add(1, attributes)
        self.rows.add(len(requests), attributes)
        self.appended.add(sum(len(r.append) for r in requests), attributes)
        self.duration.record(seconds, attributes)
        if lost:
            self.lost.add(1, attributes)


class WorkerTelemetry:
    def __init__(self, name: str, role: str, kv_usage: Callable[[], KVUsage | None] | None = None) -> None:
        """`kv_usage`: read by the metrics endpoint's KV gauge (None while the worker's model is loading)."""
        self.name, self.role = name, role
        self.kv_usage = kv_usage
        self.metrics: WorkerMetrics | None = None
        self._tracer: trace.Tracer | None = None
        self._provider: TracerProvider | None = None
        self._collector: _Collector | None = None

    def serve_metrics(self, port: int, host: str | None = None) -> str:
        """Start the /metrics endpoint (idempotent); returns its URL."""
        if self.metrics is None:
            self.metrics = WorkerMetrics(self.role, self.name, host or _node_address(), port, self.kv_usage)
        return self.metrics.endpoint.url

    def serve_metrics_from_env(self, port: int | None = None) -> None:
        """Serve /metrics from `port` (-1: not at all), else when $TANDEM_WORKER_METRICS_PORT says so; a bad setting
        is logged, never fatal."""
        setting = os.environ.get(METRICS_PORT_ENV, "").strip() if port is None else str(port)
        try:
            if setting and int(setting) >= 0:
                self.serve_metrics(int(setting), os.environ.get(METRICS_HOST_ENV) or None)
        except (ValueError, OSError) as exc:
            log.warning("%s: no metrics endpoint (%s=%r: %s)", self.name, METRICS_PORT_ENV, setting, exc)

    def evicted(self) -> None:
        """One held sequence freed for a call that came before it (workers.kv_order)."""
        if self.metrics is not None:
            self.metrics.evicted.add(1, self.metrics.base)

    @property
    def metrics_url(self) -> str | None:
        return self.metrics.endpoint.url if self.metrics is not None else None

    def call(self, method: str, requests: Sequence, trace_carriers: dict | None, run: Callable):
        """Run one pool call (`run()` returns a WorkerReply), recording metrics and, for traced rows, spans."""
        if self.metrics is None and not trace_carriers:
            return run()
        start_ns, started = time.time_ns(), time.perf_counter()
        reply = run()
        if self.metrics is not None:
            self.metrics.record(method, requests, time.perf_counter() - started, bool(reply.lost))
        if trace_carriers and not tracing.sdk_disabled():
            reply.spans = self._trace(method, requests, reply, trace_carriers, start_ns, time.time_ns())
        return reply

    def _trace(self, method: str, requests: Sequence, reply, carriers: dict, start_ns: int, end_ns: int):
        groups: dict[str, tuple[dict, list[int]]] = {}
        for row, request in enumerate(requests):
            carrier = carriers.get(request.seq_id)
            if carrier:
                groups.setdefault(carrier.get("traceparent", ""), (carrier, []))[1].append(row)
        tracer = self._tracer or self._start_tracing()
        for carrier, rows in groups.values():
            results = [reply.results[i] for i in rows] if reply.results is not None else None
            attributes = {"tandem.worker.name": self.name, "tandem.worker.role": self.role,
                          "tandem.batch.size": len(requests), **_row_attributes(method, [requests[i] for i in rows],
                                                                                 results)}
            if reply.lost:
                attributes["tandem.state_lost"] = True
            span = tracer.start_span(SPAN_NAMES.get(method, f"tandem.worker.{method}"),
                                     context=tracing.context_from(carrier), kind=trace.SpanKind.SERVER,
                                     attributes=attributes, start_time=start_ns)
            span.end(end_time=end_ns)
        return tracing.encode_spans(self._collector.drain()) if self._collector is not None else None

    def close(self) -> None:
        """Flush spans and stop the metrics endpoint (a worker process also flushes at exit)."""
        if self._provider is not None:
            self._provider.shutdown()
        if self.metrics is not None:
            self.metrics.endpoint.close()

    def _start_tracing(self) -> trace.Tracer:
        resource = tracing.resource_for(f"tandem-{self.role}-worker", **{
            "service.instance.id": f"{self.name}-{os.getpid()}", "tandem.worker.name": self.name,
            "process.pid": os.getpid()})
        provider = self._provider = TracerProvider(resource=resource)
        exporters = tracing.exporters_from_env()
        if exporters:
            for exporter in exporters:
                provider.add_span_processor(BatchSpanProcessor(exporter))
        else:
            self._collector = _Collector()
            provider.add_span_processor(self._collector)
        self._tracer = provider.get_tracer(tracing.TRACER_NAME)
        return self._tracer


def _node_address() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:
        pass
    return "127.0.0.1"
