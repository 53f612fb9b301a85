"""TandemClient: the blocking client."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Unpack

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.client.channel import DEFAULT_ADDRESS, ChannelSettings, PemSource
from tandem.client.requests import ChatMessages, GenerateOptions, build_request, build_tokenize_request
from tandem.client.results import Collector, GenerateResult, _first_choice, _unwrap
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc


class TandemClient:
    def __init__(self, target: str = DEFAULT_ADDRESS, *, timeout: float | None = None, tls: bool = False,
                 root_certificates: PemSource | None = None, private_key: PemSource | None = None,
                 certificate_chain: PemSource | None = None, api_key: str | None = None,
                 options: Sequence[tuple[str, Any]] = ()) -> None:
        """target: HOST:PORT (or any grpc target). timeout: default deadline in seconds for each call (None: no
        deadline). tls: a secure channel, verified against root_certificates (PEM bytes, text or a file path; None:
        grpc's bundled roots); private_key + certificate_chain: mutual TLS. api_key: `authorization: Bearer` on
        every call."""
        self.settings = ChannelSettings(target, tls, root_certificates, private_key, certificate_chain, api_key,
                                        tuple(options))
        self.address = target
        self.timeout = timeout
        self.channel = (grpc.secure_channel(target, self.settings.credentials(), options=self.settings.options)
                        if tls else grpc.insecure_channel(target, options=self.settings.options))
        self.stub = generation_pb2_grpc.GenerationServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                 **options: Unpack[GenerateOptions]) -> Iterator[pb.Chunk | pb.Complete]:
        """Stream Chunk messages and, for each of the n choices, a Complete (Chunk.index and Complete.index say
        which choice). Closing the iterator early cancels the request. The request is built (and checked) at once,
        before the first next(); the current OpenTelemetry span, if any, travels as W3C trace context."""
        request = build_request(prompt, **options)
        return self._stream(request, timeout)

    def _stream(self, request: pb.GenerateRequest, timeout: float | None) -> Iterator[pb.Chunk | pb.Complete]:
        call = self.stub.Generate(request, timeout=self._timeout(timeout), metadata=self.settings.metadata())
        try:
            for response in call:
                yield _unwrap(response)
        finally:
            call.cancel()

    def generate_result(self, prompt: str | None = None, *, timeout: float | None = None,
                        **options: Unpack[GenerateOptions]) -> GenerateResult:
        """The whole stream collected: text, token ids, finish reason, usage and speculation stats per choice."""
        collector = Collector(logprobs=options.get("logprobs") is not None,
                              prompt_logprobs=options.get("prompt_logprobs") is not None)
        for item in self.generate(prompt, timeout=timeout, **options):
            collector.add(item)
        return collector.result()

    def generate_text(self, prompt: str | None = None, *, timeout: float | None = None,
                      **options: Unpack[GenerateOptions]) -> tuple[str, pb.Complete]:
        """(text, Complete) of the first choice: the older form of generate_result."""
        return _first_choice(self.generate(prompt, timeout=timeout, **options))

    def tokenize(self, prompt: str | None = None, *, chat: ChatMessages | None = None,
                 tools: Iterable[Mapping[str, Any]] = (), timeout: float | None = None) -> list[int]:
        """The target tokenizer's ids for a raw prompt, or for a chat with the chat template applied (and its
        tools shown, as generate shows them)."""
        response = self.stub.Tokenize(build_tokenize_request(prompt, chat=chat, tools=tools),
                                      timeout=self._timeout(timeout), metadata=self.settings.metadata())
        return list(response.token_ids)

    def abort(self, request_id: str, *, timeout: float | None = None) -> bool:
        """Stop a running request by id; False when the gateway knows no such running request."""
        return self.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=self._timeout(timeout),
                               metadata=self.settings.metadata()).found

    def model_info(self, *, timeout: float | None = None) -> pb.GetModelInfoResponse:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self._timeout(timeout),
                                      metadata=self.settings.metadata())

    def health_status(self, service: str = "", *, timeout: float | None = None) -> int:
        """grpc.health.v1 status of `service` ("" liveness, READINESS_SERVICE readiness)."""
        request = health_pb2.HealthCheckRequest(service=service)
        return self.health.Check(request, timeout=self._timeout(timeout), metadata=self.settings.metadata()).status

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> TandemClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
