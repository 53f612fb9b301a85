"""Per-call cost of the instrumentation (tandem.telemetry): `python -m tandem.bench.overhead`.

Measures what one Generate call, one engine step and one pool call pay with tracing off (and metrics off / on),
and, with tracing on, a round recorded as a child span against a span event.
"""

from __future__ import annotations

import argparse
import timeit

from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tandem.cli.options import DefaultsHelpFormatter, add_json_option, wants_text, write_json
from tandem.core.stats import RequestStats
from tandem.telemetry import tracing
from tandem.telemetry.gateway import RequestObserver
from tandem.telemetry.rounds import RoundTracer
from tandem.v1 import generation_pb2 as pb


class _Prepared:
    request_id, session_id, prompt_ids, max_k = "req-1", "", [1, 2, 3], None

    class params:  # stands in for SamplingParams
        temperature, top_p, top_k, max_tokens, seed, stop = 0.0, 1.0, 0, 64, None, ()


def _request_path(metrics, chunks: int = 64) -> None:
    request = pb.GenerateRequest(prompt="hi")
    observed = RequestObserver(metrics, request, (), "model")
    observed.prepared(_Prepared)
    for _ in range(chunks):
        observed.tokens(1)
    observed.completed(3, chunks, "length", RequestStats(rounds=16).report(False, 0))
    observed.end()


def _microseconds(statement, number: int) -> float:
    return min(timeit.repeat(statement, number=number, repeat=5)) / number * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    add_json_option(parser, "the figures, in microseconds, one key per line of the text")
    args = parser.parse_args(argv)
    figures: dict[str, float] = {}

    def report(key: str, label: str, microseconds: float, unit: str = "us", digits: int = 2) -> None:
        figures[key] = microseconds
        if wants_text(args):
            shown = microseconds * 1000 if unit == "ns" else microseconds
            print(f"{label}: {shown:.{digits}f} {unit}")

    from tandem.telemetry.metrics import GatewayMetrics

    tracing.shutdown()
    rounds = RoundTracer()
    carriers: dict = {}
    report("generate_tracing_off_metrics_off_us", "tracing off, metrics off: one Generate call, 64 chunks",
           _microseconds(lambda: _request_path(None), 2000))
    metrics = GatewayMetrics("127.0.0.1", [0])
    try:
        report("generate_tracing_off_metrics_on_us", "tracing off, metrics on:  one Generate call, 64 chunks",
               _microseconds(lambda: _request_path(metrics), 2000))
    finally:
        metrics.close()
    report("step_checks_tracing_off_us", "tracing off: engine-loop checks per step (rounds.active, trace None)",
           _microseconds(lambda: rounds.active or None, 200000), "ns", 1)
    report("pool_carrier_check_tracing_off_us", "tracing off: pool call carrier check",
           _microseconds(lambda: bool(carriers), 200000), "ns", 1)
    report("client_outgoing_metadata_us", "client with no active span: outgoing_metadata()",
           _microseconds(tracing.outgoing_metadata, 100000), digits=3)

    provider = tracing.install([SimpleSpanProcessor(InMemorySpanExporter())])
    tracer = provider.get_tracer("overhead")
    parent = tracer.start_span("request")
    context = trace.set_span_in_context(parent)

    def round_span() -> None:
        span = tracer.start_span("tandem.spec.round", context=context)
        span.set_attributes({"tandem.spec.k": 4, "tandem.spec.accepted": 3, "tandem.spec.fallback": False})
        span.end()

    def round_event() -> None:
        parent.add_event("tandem.spec.round", {"tandem.spec.k": 4, "tandem.spec.accepted": 3,
                                               "tandem.spec.fallback": False})

    report("round_span_us", "tracing on: a round as a child span (in-memory exporter)", _microseconds(round_span, 5000))
    report("round_event_us", "tracing on: a round as a span event", _microseconds(round_event, 5000))
    report("round_carrier_us", "tracing on: W3C carrier for a round span",
           _microseconds(lambda: tracing.carrier_for(parent), 5000))
    tracing.shutdown()
    write_json(args.json, figures)

if __name__ == "__main__":
    main()
