"""AsyncTandemClient: the asyncio client."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any, Unpack

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.client.channel import DEFAULT_ADDRESS, ChannelSettings, PemSource
from tandem.client.requests import ChatMessages, GenerateOptions, build_request, build_tokenize_request
from tandem.client.results import Collector, GenerateResult, _first_choice, _unwrap
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc


class AsyncTandemClient:
    """The asyncio twin of TandemClient (same constructor and methods, awaitable; generate is an async iterator).
    Make it inside the event loop that uses it."""

    def __init__(self, target: str = DEFAULT_ADDRESS, *, timeout: float | None = None, tls: bool = False,
                 root_certificates: PemSource | None = None, private_key: PemSource | None = None,
                 certificate_chain: PemSource | None = None, api_key: str | None = None,
                 options: Sequence[tuple[str, Any]] = ()) -> None:
        self.settings = ChannelSettings(target, tls, root_certificates, private_key, certificate_chain, api_key,
                                        tuple(options))
        self.address = target
        self.timeout = timeout
        self.channel = (grpc.aio.secure_channel(target, self.settings.credentials(), options=self.settings.options)
                        if tls else grpc.aio.insecure_channel(target, options=self.settings.options))
        self.stub = generation_pb2_grpc.GenerationServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                 **options: Unpack[GenerateOptions]) -> AsyncIterator[pb.Chunk | pb.Complete]:
        """As TandemClient.generate; leaving the `async for` early (or cancelling its task) cancels the request."""
        request = build_request(prompt, **options)
        return self._stream(request, timeout)

    async def _stream(self, request: pb.GenerateRequest,
                      timeout: float | None) -> AsyncIterator[pb.Chunk | pb.Complete]:
        call = self.stub.Generate(request, timeout=self._timeout(timeout), metadata=self.settings.metadata())
        try:
            async for response in call:
                yield _unwrap(response)
        finally:
            call.cancel()

    async def generate_result(self, prompt: str | None = None, *, timeout: float | None = None,
                              **options: Unpack[GenerateOptions]) -> GenerateResult:
        collector = Collector(logprobs=options.get("logprobs") is not None,
                              prompt_logprobs=options.get("prompt_logprobs") is not None)
        async for item in self.generate(prompt, timeout=timeout, **options):
            collector.add(item)
        return collector.result()

    async def generate_text(self, prompt: str | None = None, *, timeout: float | None = None,
                            **options: Unpack[GenerateOptions]) -> tuple[str, pb.Complete]:
        return _first_choice([item async for item in self.generate(prompt, timeout=timeout, **options)])

    async def tokenize(self, prompt: str | None = None, *, chat: ChatMessages | None = None,
                       tools: Iterable[Mapping[str, Any]] = (), timeout: float | None = None) -> list[int]:
        response = await self.stub.Tokenize(build_tokenize_request(prompt, chat=chat, tools=tools),
                                            timeout=self._timeout(timeout), metadata=self.settings.metadata())
        return list(response.token_ids)

    async def abort(self, request_id: str, *, timeout: float | None = None) -> bool:
        response = await self.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=self._timeout(timeout),
                                         metadata=self.settings.metadata())
        return response.found

    async def model_info(self, *, timeout: float | None = None) -> pb.GetModelInfoResponse:
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self._timeout(timeout),
                                            metadata=self.settings.metadata())

    async def health_status(self, service: str = "", *, timeout: float | None = None) -> int:
        request = health_pb2.HealthCheckRequest(service=service)
        response = await self.health.Check(request, timeout=self._timeout(timeout), metadata=self.settings.metadata())
        return response.status

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncTandemClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()
