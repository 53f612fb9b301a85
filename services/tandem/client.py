"""Python clients for a tandem gateway: TandemClient (blocking) and AsyncTandemClient (asyncio).

    with TandemClient("127.0.0.1:50051") as client:
        for item in client.generate(prompt="def fib(n):", temperature=0, max_tokens=64):
            ...  # pb.Chunk messages, then one pb.Complete
        text, complete = client.generate_text(chat=[("user", "hi")])

Failures surface as grpc.RpcError (see .code() and .details()).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator, Mapping

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.errors import InvalidArgument
from tandem.telemetry.propagation import outgoing_metadata
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "max_tokens")
SPECULATION_MODES = {"auto": pb.SpeculationOptions.MODE_AUTO, "off": pb.SpeculationOptions.MODE_OFF}
ChatMessages = Iterable[tuple[str, str] | Mapping[str, str]]


def build_request(prompt: str | None = None, *, token_ids: Iterable[int] | None = None,
                  chat: ChatMessages | None = None, request_id: str = "", session_id: str = "",
                  stop: Iterable[str] = (), stop_token_ids: Iterable[int] = (), ignore_eos: bool = False,
                  speculation: str = "auto", max_k: int | None = None, **sampling) -> pb.GenerateRequest:
    """A GenerateRequest from keyword options; sampling keywords: temperature, top_p, top_k, seed, max_tokens."""
    if sum(x is not None for x in (prompt, token_ids, chat)) != 1:
        raise InvalidArgument("input: pass exactly one of prompt, token_ids or chat")
    if unknown := sorted(set(sampling) - set(SAMPLING_FIELDS)):
        raise InvalidArgument(f"{unknown[0]}: not a sampling option (expected one of {', '.join(SAMPLING_FIELDS)})")
    if speculation not in SPECULATION_MODES:
        raise InvalidArgument(f"speculation: must be one of {', '.join(SPECULATION_MODES)}, got {speculation!r}")
    request = pb.GenerateRequest(
        request_id=request_id, session_id=session_id, stop=list(stop), stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos,
        sampling=pb.SamplingParams(**{k: v for k, v in sampling.items() if v is not None}),
        speculation=pb.SpeculationOptions(mode=SPECULATION_MODES[speculation], max_k=max_k),
    )
    if prompt is not None:
        request.prompt = prompt
    elif token_ids is not None:
        request.token_ids.ids.extend(token_ids)
    else:
        for message in chat:
            role, content = (message["role"], message["content"]) if isinstance(message, Mapping) else message
            request.chat.messages.add(role=role, content=content)
    return request


def _unwrap(response: pb.GenerateResponse) -> pb.Chunk | pb.Complete:
    return response.chunk if response.WhichOneof("kind") == "chunk" else response.complete


def _collect(items: Iterable[pb.Chunk | pb.Complete]) -> tuple[str, pb.Complete]:
    parts: list[str] = []
    complete = None
    for item in items:
        if isinstance(item, pb.Chunk):
            parts.append(item.text)
        else:
            complete = item
    if complete is None:
        raise RuntimeError("the stream ended without a Complete message")
    return "".join(parts), complete


class TandemClient:
    def __init__(self, address: str, timeout: float | None = None) -> None:
        """timeout: default deadline in seconds for each call (None: no deadline)."""
        self.address = address
        self.timeout = timeout
        self.channel = grpc.insecure_channel(address)
        self.stub = generation_pb2_grpc.GenerationServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                 **options) -> Iterator[pb.Chunk | pb.Complete]:
        """Stream Chunk messages, then a Complete. Closing the iterator early cancels the request.

        The current OpenTelemetry span, if any, travels as W3C trace context in the call's metadata."""
        call = self.stub.Generate(build_request(prompt, **options), timeout=timeout or self.timeout,
                                  metadata=outgoing_metadata())
        try:
            for response in call:
                yield _unwrap(response)
        finally:
            call.cancel()

    def generate_text(self, prompt: str | None = None, **options) -> tuple[str, pb.Complete]:
        return _collect(self.generate(prompt, **options))

    def abort(self, request_id: str) -> bool:
        return self.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=self.timeout).found

    def model_info(self) -> pb.GetModelInfoResponse:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout)

    def health_status(self, service: str = "") -> int:
        """grpc.health.v1 status of `service` ("" liveness, "tandem.v1.GenerationService" readiness)."""
        request = health_pb2.HealthCheckRequest(service=service)
        return self.health.Check(request, timeout=self.timeout).status

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> TandemClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class AsyncTandemClient:
    def __init__(self, address: str, timeout: float | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = generation_pb2_grpc.GenerationServiceStub(self.channel)

    async def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                       **options) -> AsyncIterator[pb.Chunk | pb.Complete]:
        call = self.stub.Generate(build_request(prompt, **options), timeout=timeout or self.timeout,
                                  metadata=outgoing_metadata())
        try:
            async for response in call:
                yield _unwrap(response)
        finally:
            call.cancel()

    async def generate_text(self, prompt: str | None = None, **options) -> tuple[str, pb.Complete]:
        return _collect([item async for item in self.generate(prompt, **options)])

    async def abort(self, request_id: str) -> bool:
        return (await self.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=self.timeout)).found

    async def model_info(self) -> pb.GetModelInfoResponse:
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncTandemClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()
