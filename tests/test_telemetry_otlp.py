"""The deployment path: OTEL_EXPORTER_OTLP_ENDPOINT alone turns tracing on, and the gateway and a worker with that
environment export over real OTLP/gRPC to a collector (here a TraceService on loopback, in this test)."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from gateway_harness import ServerThread, tiny_backend
from tandem.client import TandemClient
from tandem.core.config import SamplingParams
from tandem.core.protocol import DraftProposal, DraftRequest
from tandem.telemetry import tracing
from tandem.telemetry.worker import WorkerTelemetry
from tandem.workers.worker_base import WorkerReply


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[tuple[str, str, bytes]] = []  # (service.name, span name, trace id)
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                service = next(a.value.string_value for a in resource_spans.resource.attributes
                               if a.key == "service.name")
                self.spans += [(service, span.name, span.trace_id) for scope in resource_spans.scope_spans
                               for span in scope.spans]
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, condition, timeout: float = 20.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if condition(self.spans):
                    return True
            time.sleep(0.05)
        return False


@pytest.fixture
def collector(monkeypatch):
    servicer = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    for name in ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    yield servicer
    tracing.shutdown()
    server.stop(0)


def test_gateway_exports_over_otlp_from_the_environment(collector, tiny_models) -> None:
    assert tracing.setup_from_env("tandem-gateway") == ["otlp"] and tracing.enabled()
    server = ServerThread(tiny_backend(tiny_models[0], tiny_models[1]), metrics_port=None)
    try:
        with TandemClient(server.address, timeout=60) as client:
            client.generate_text(token_ids=[5, 6, 7], temperature=0.0, max_tokens=8, ignore_eos=True)
    finally:
        server.stop()
    tracing.shutdown()  # flushes the batch processor
    names = [name for service, name, _ in collector.spans if service == "tandem-gateway"]
    assert "text_completion tiny-target" in names and "tandem.prefill" in names and "tandem.spec.round" in names


def test_a_worker_with_an_otlp_endpoint_exports_its_spans_itself(collector) -> None:
    with_tracing = tracing.install([], "tandem-gateway")  # a parent span for the worker's call
    parent = with_tracing.get_tracer("tests").start_span("round")
    carrier = tracing.carrier_for(parent)
    worker = WorkerTelemetry("draft-7", "draft")
    request = DraftRequest("seq-1", 0, [1, 2, 3], 2, SamplingParams(temperature=0.0))
    reply = worker.call("propose", [request], {"seq-1": carrier},
                        lambda: WorkerReply(results=[DraftProposal(tokens=[4, 5])]))
    assert reply.spans is None  # exported directly, not relayed through the gateway
    worker.close()
    trace_id = parent.get_span_context().trace_id.to_bytes(16, "big")
    assert collector.wait_for(lambda spans: ("tandem-draft-worker", "tandem.draft.propose", trace_id) in spans)


def test_without_an_exporter_a_worker_returns_its_spans_for_the_gateway(monkeypatch) -> None:
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    provider = tracing.install([], "tandem-gateway")
    try:
        parent = provider.get_tracer("tests").start_span("round")
        worker = WorkerTelemetry("draft-1", "draft")
        request = DraftRequest("seq-1", 0, [1, 2, 3], 2, SamplingParams(temperature=0.0))
        reply = worker.call("propose", [request], {"seq-1": tracing.carrier_for(parent)},
                            lambda: WorkerReply(results=[DraftProposal(tokens=[4])]))
    finally:
        tracing.shutdown()
    [data] = reply.spans
    span = tracing.decode_span(data)
    assert span.parent.span_id == parent.get_span_context().span_id
    assert span.context.trace_id == parent.get_span_context().trace_id
    assert span.resource.attributes["service.name"] == "tandem-draft-worker"
    assert span.attributes["tandem.spec.drafted"] == 1 and span.attributes["tandem.tokens.appended"] == 3
    assert span.end_time >= span.start_time
