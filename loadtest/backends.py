"""How the load tester talks to tandem: gRPC (tandem.v1.GenerationService) or OpenAI's HTTP API (SSE streams).

A backend turns one streamed request into the events the driver times (loadtest/client_run.py), identical for both:
- an int: the tokens of one chunk (gRPC: a Chunk's token ids; HTTP: one SSE chunk, see OpenAIBackend for the count);
- a Final: the end of the stream (gRPC: the Complete; HTTP: the chunk with finish_reason), with usage and tandem's
  speculation stats. The OpenAI backend fills its usage from the usage chunk that follows, before the stream ends.
Failures raise RequestFailed("KIND: details"): the gRPC status name, or HTTP_<status> / the HTTP server's error
type / the transport's exception, so results.json's error_kinds count them alike.

The request, the events and the Backend interface are loadtest/backend_base.py's, the OpenAI backend is
loadtest/openai_backend.py's; the gRPC backend and backend_for, which picks one, are here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

from loadtest.backend_base import READY_POLL_SECONDS, Backend, Final, RequestFailed, RequestSpec, ServerUnreachable
from loadtest.config import RunConfig
from loadtest.openai_backend import OpenAIBackend

CHANNEL_OPTIONS = [("grpc.enable_http_proxy", 0)]  # loopback targets: never route through a proxy from the env


def backend_for(config: RunConfig) -> Backend:
    return OpenAIBackend(config) if config.backend == "openai" else GrpcBackend(config)


# --- gRPC ---------------------------------------------------------------------------------------------------------


class GrpcBackend(Backend):
    def __init__(self, config: RunConfig) -> None:
        import grpc

        from tandem.v1 import generation_pb2_grpc

        super().__init__(config)
        self.grpc = grpc
        if config.tls:
            root, key, chain = (Path(path).read_bytes() if path else None
                                for path in (config.ca, config.client_key, config.client_cert))
            self.channel = grpc.aio.secure_channel(config.address, grpc.ssl_channel_credentials(root, key, chain),
                                                   options=CHANNEL_OPTIONS)
        else:
            self.channel = grpc.aio.insecure_channel(config.address, options=CHANNEL_OPTIONS)
        self.stub = generation_pb2_grpc.GenerationServiceStub(self.channel)
        self.metadata = (("authorization", f"Bearer {config.api_key}"),) if config.api_key else None

    async def open(self) -> dict:
        from google.protobuf.json_format import MessageToDict

        from tandem.v1 import generation_pb2 as pb

        config = self.config
        deadline = time.monotonic() + config.connect_timeout
        try:
            await asyncio.wait_for(self.channel.channel_ready(), config.connect_timeout)
        except TimeoutError:
            raise ServerUnreachable(f"no server answered at {config.address} within "
                                    f"{config.connect_timeout:g} s") from None
        await self.wait_ready(deadline)
        try:
            info = await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=config.connect_timeout,
                                                metadata=self.metadata)
            return MessageToDict(info, preserving_proto_field_name=True)
        except self.grpc.aio.AioRpcError as exc:
            return {"error": f"{exc.code().name}: {exc.details()}"}

    async def wait_ready(self, deadline: float) -> None:
        """Poll the server's readiness (grpc.health.v1, for the GenerationService) until it is SERVING: a tandem
        server answers on its port at once but refuses requests (UNAVAILABLE) while it loads its models, so
        `tandem serve ... & python -m loadtest ...` waits for it, up to the connect timeout (`deadline`). A server
        without the health service, or without that readiness entry, is taken as ready."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from tandem.client import READINESS_SERVICE

        health = health_pb2_grpc.HealthStub(self.channel)
        request = health_pb2.HealthCheckRequest(service=READINESS_SERVICE)
        code, status = self.grpc.StatusCode, "UNKNOWN"
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                response = await health.Check(request, timeout=remaining, metadata=self.metadata)
            except self.grpc.aio.AioRpcError as exc:
                if exc.code() in (code.UNIMPLEMENTED, code.NOT_FOUND):
                    return
                status = exc.code().name
            else:
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
            await asyncio.sleep(min(READY_POLL_SECONDS, max(0.0, deadline - time.monotonic())))
        raise ServerUnreachable(f"the server at {self.config.address} answered but was not ready within "
                                f"{self.config.connect_timeout:g} s (readiness {status})")

    async def close(self) -> None:
        await self.channel.close()

    async def stream(self, request: RequestSpec) -> AsyncIterator[int | Final]:
        from tandem.client import build_request
        from tandem.v1 import generation_pb2 as pb

        call = self.stub.Generate(build_request(
            **request.prompt.request_input(), request_id=request.request_id, session_id=request.session_id,
            max_tokens=request.max_tokens, temperature=request.temperature, seed=request.seed,
            ignore_eos=request.ignore_eos, speculation=request.speculation, max_k=request.max_k,
            priority=request.priority),
            timeout=self.config.timeout, metadata=self.metadata)
        try:
            async for response in call:
                if response.WhichOneof("kind") == "chunk":
                    yield len(response.chunk.token_ids)
                    continue
                complete = response.complete
                stats = complete.speculation
                yield Final(pb.FinishReason.Name(complete.finish_reason), complete.usage.prompt_tokens,
                            complete.usage.completion_tokens, stats.rounds, stats.drafted_tokens,
                            stats.accepted_tokens, stats.fallback_rounds, stats.draft_failures)
        except self.grpc.aio.AioRpcError as exc:
            raise RequestFailed(f"{exc.code().name}: {exc.details()}") from None
        finally:
            call.cancel()  # a cancelled task or an early close frees the server's caches
