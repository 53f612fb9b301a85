"""What the servicer records per Generate call: the GenAI SERVER span and the gen_ai.server.* histograms.

The span is named "{gen_ai.operation.name} {gen_ai.request.model}": "chat" for chat input, "text_completion" for a
prompt or token ids. It is a child of the W3C context in the call's metadata, and is passed (not made current) to
the engine loop, which hangs the round spans under it. With tracing off no span is created; with metrics off no
histogram is touched; a request then costs a few attribute reads and one perf_counter per call here.
"""

from __future__ import annotations

import time

from opentelemetry import trace

from tandem.core.stats import SpeculationReport
from tandem.telemetry import tracing
from tandem.telemetry.metrics import PROVIDER, GatewayMetrics

OPERATIONS = {"chat": "chat", "prompt": "text_completion", "token_ids": "text_completion"}
SPEC_ATTRIBUTES = {"rounds": "tandem.spec.rounds", "drafted": "tandem.spec.drafted_tokens",
                   "accepted": "tandem.spec.accepted_tokens", "acceptance_rate": "tandem.spec.acceptance",
                   "mean_accepted_length": "tandem.spec.mean_accepted_length",
                   "fallback_rounds": "tandem.spec.fallback_rounds", "draft_failures": "tandem.spec.draft_failures",
                   "fallback": "tandem.spec.fallback", "final_k": "tandem.spec.final_k"}


class RequestObserver:
    """One Generate call; methods are cheap no-ops for whatever is switched off."""

    __slots__ = ("_ended", "attributes", "first_token", "metrics", "span", "started")

    def __init__(self, metrics: GatewayMetrics | None, request, metadata, model: str) -> None:
        self.started = time.perf_counter()
        self.first_token: float | None = None
        self.metrics = metrics
        self._ended = False
        self.span: trace.Span | None = None
        operation = OPERATIONS.get(request.WhichOneof("input") or "", "text_completion")
        self.attributes = {"gen_ai.operation.name": operation, "gen_ai.provider.name": PROVIDER,
                           "gen_ai.request.model": model}
        if tracing.enabled():
            # Under the HTTP server's own span where one is current (FastAPI's, itself parented by the request's
            # traceparent); a gRPC call's parent is the context in its metadata.
            within = trace.get_current_span().get_span_context().is_valid
            span = tracing.tracer().start_span(
                f"{operation} {model}", context=None if within else tracing.extract_metadata(metadata),
                kind=trace.SpanKind.INTERNAL if within else trace.SpanKind.SERVER,
                attributes=self.attributes | {"gen_ai.system": PROVIDER, "rpc.system": "grpc",
                                              "rpc.service": "tandem.v1.GenerationService", "rpc.method": "Generate"})
            self.span = span if span.is_recording() else None  # sampled out: nothing downstream records either

    def prepared(self, prepared) -> None:
        if self.span is None:
            return
        params = prepared.params
        attributes = {"gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p,
                      "gen_ai.request.top_k": params.top_k, "gen_ai.request.max_tokens": params.max_tokens,
                      "gen_ai.response.id": prepared.request_id,
                      "gen_ai.usage.input_tokens": len(prepared.prompt_ids)}
        if params.seed is not None:
            attributes["gen_ai.request.seed"] = params.seed
        if params.stop:
            attributes["gen_ai.request.stop_sequences"] = list(params.stop)
        if prepared.session_id:
            attributes["gen_ai.conversation.id"] = prepared.session_id
        if prepared.max_k is not None:
            attributes["tandem.spec.max_k"] = prepared.max_k
        self.span.set_attributes(attributes)

    def tokens(self, count: int) -> None:
        if count and self.first_token is None:
            self.first_token = time.perf_counter()

    def completed(self, prompt_tokens: int, completion_tokens: int, finish_reason: str,
                  stats: SpeculationReport) -> None:
        ended = time.perf_counter()
        if self.metrics is not None:
            attributes = self.attributes | {"gen_ai.response.model": self.attributes["gen_ai.request.model"]}
            self.metrics.duration.record(ended - self.started, attributes)
            if self.first_token is not None:
                self.metrics.ttft.record(self.first_token - self.started, attributes)
                if completion_tokens > 1:
                    self.metrics.tpot.record((ended - self.first_token) / (completion_tokens - 1), attributes)
        if self.span is not None:
            attributes = {"gen_ai.usage.input_tokens": prompt_tokens, "gen_ai.usage.output_tokens": completion_tokens,
                          "gen_ai.response.finish_reasons": [finish_reason],
                          "gen_ai.response.model": self.attributes["gen_ai.request.model"]}
            attributes |= {name: stats[key] for key, name in SPEC_ATTRIBUTES.items()}
            self.span.set_attributes(attributes)
        self._end()

    def failed(self, code_name: str, message: str = "") -> None:
        """The call ended with a gRPC error status (INVALID_ARGUMENT, CANCELLED, ...)."""
        if self._ended:
            return
        if self.metrics is not None:
            attributes = self.attributes | {"error.type": code_name}
            self.metrics.duration.record(time.perf_counter() - self.started, attributes)
        if self.span is not None:
            self.span.set_attribute("error.type", code_name)
            self.span.set_attribute("rpc.grpc.status_code", code_name)
            self.span.set_status(trace.Status(trace.StatusCode.ERROR, message or code_name))
        self._end()

    def end(self) -> None:
        """The call is over: anything not completed or failed by now was cancelled by the client."""
        if not self._ended:
            self.failed("CANCELLED", "the client cancelled the call or its deadline passed")

    def _end(self) -> None:
        self._ended = True
        if self.span is not None:
            self.span.end()
