"""The tandem.v1.GenerationService servicer: the gRPC face of the gateway's generate path (gateway.generation)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from tandem.core.logprobs import TokenLogprob
from tandem.core.stops import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP
from tandem.errors import InvalidArgument
from tandem.gateway.auth import ApiKeys
from tandem.gateway.generation import FAILURES, ChoiceDelta, ChoiceEnd, Generations, error_code
from tandem.gateway.loop import EngineFailed
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc

log = logging.getLogger(__name__)

HEALTH_METHODS = "/grpc.health.v1.Health/"  # probes (kubelet, load balancers) carry no key: always open
UNAUTHENTICATED_MESSAGE = "missing or unknown API key: send `authorization: Bearer <key>` metadata"
FINISH_REASONS = {FINISH_STOP: pb.FINISH_REASON_STOP, FINISH_LENGTH: pb.FINISH_REASON_LENGTH,
                  FINISH_ABORT: pb.FINISH_REASON_ABORT}


MALFORMED = "request: the bytes are not a valid {} message"
INTERNAL_ERROR = "the server failed handling this request; the error is in its log"


def _status(exc: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, EngineFailed):
        # Its own text (an exception's, which may name the server's files) stays in the log: the client gets what
        # failed ("engine step failed", "add failed") only.
        log.warning("request failed in the engine: %s", exc)
        return grpc.StatusCode.INTERNAL, f"{str(exc).partition(':')[0]}; the error is in the server's log"
    return grpc.StatusCode[error_code(exc)], str(exc)


class _Malformed:
    """What the lenient deserializer hands the servicer for bytes that do not parse: grpc answers a deserializer that
    raises with UNKNOWN, a malformed request is the client's error (INVALID_ARGUMENT)."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


def _lenient(parse, type_name: str):
    def deserialize(data: bytes):
        try:
            return parse(data)
        except Exception:  # google.protobuf.message.DecodeError, or anything else the parser raises
            return _Malformed(MALFORMED.format(type_name))

    return deserialize


def _guarded(behaviour, streaming: bool):
    """`behaviour` refusing malformed requests (INVALID_ARGUMENT), an unexpected exception an INTERNAL without its
    text (grpc's own UNKNOWN would carry it to the client)."""
    if streaming:
        async def stream(request, context: grpc.aio.ServicerContext):
            if isinstance(request, _Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            failed = False
            try:
                async for response in behaviour(request, context):
                    yield response
            except grpc.aio.AbortError:
                raise
            except Exception:
                log.exception("%s failed", getattr(behaviour, "__name__", "a call"))
                failed = True
            if failed:
                await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_ERROR)

        return stream

    async def unary(request, context: grpc.aio.ServicerContext):
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            return await behaviour(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception:
            log.exception("%s failed", getattr(behaviour, "__name__", "a call"))
        await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_ERROR)

    return unary


class _Collector:
    """Stands in for a server to collect the method handlers generated code registers."""

    def __init__(self) -> None:
        self.handlers: dict[str, dict] = {}

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.handlers[service] = handlers


def add_to_server(servicer: GenerationServiceServicer, server: grpc.aio.Server) -> None:
    """Register the servicer as generation_pb2_grpc does, with lenient deserializers (malformed bytes are
    INVALID_ARGUMENT, not UNKNOWN) and handlers that never put an unexpected exception's text in a status."""
    collector = _Collector()
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, collector)
    for service, handlers in collector.handlers.items():
        methods = pb.DESCRIPTOR.services_by_name[service.rpartition(".")[2]].methods_by_name
        guarded = {}
        for name, handler in handlers.items():
            streaming = handler.unary_stream is not None
            behaviour = handler.unary_stream if streaming else handler.unary_unary
            if behaviour is None or handler.request_streaming:  # no such methods today: registered as generated
                guarded[name] = handler
                continue
            kind = "unary_stream" if streaming else "unary_unary"
            guarded[name] = handler._replace(
                request_deserializer=_lenient(handler.request_deserializer, methods[name].input_type.full_name),
                **{kind: _guarded(behaviour, streaming)})
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, guarded),))
        server.add_registered_method_handlers(service, guarded)


def speculation_stats(stats: dict) -> pb.SpeculationStats:
    return pb.SpeculationStats(
        rounds=stats.get("rounds", 0),
        drafted_tokens=stats.get("drafted", 0),
        accepted_tokens=stats.get("accepted", 0),
        acceptance_rate=stats.get("acceptance_rate", 0.0),
        mean_accepted_length=stats.get("mean_accepted_length", 0.0),
        fallback_rounds=stats.get("fallback_rounds", 0),
        acceptance_per_position=stats.get("acceptance_per_position", []),
        draft_failures=stats.get("draft_failures", 0),
    )


def chunk_message(delta: ChoiceDelta) -> pb.GenerateResponse:
    return pb.GenerateResponse(chunk=pb.Chunk(text=delta.text, token_ids=delta.token_ids, index=delta.index,
                                              logprobs=_logprobs(delta.logprobs)))


def _logprobs(logprobs: list[TokenLogprob] | None) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                            top=[pb.TopLogprob(token_id=i, logprob=v) for i, v in lp.top])
            for lp in logprobs or ()]


def complete_message(end: ChoiceEnd) -> pb.GenerateResponse:
    return pb.GenerateResponse(complete=pb.Complete(
        finish_reason=FINISH_REASONS.get(end.finish_reason, pb.FINISH_REASON_UNSPECIFIED),
        usage=pb.Usage(prompt_tokens=end.prompt_tokens, completion_tokens=end.completion_tokens),
        speculation=speculation_stats(end.stats),
        request_id=end.request_id,
        index=end.index,
    ))


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Every method but grpc.health.v1 needs a known API key (GenerationService and reflection alike): a call
    without one ends UNAUTHENTICATED before its handler runs."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(HEALTH_METHODS):
            return handler
        if self.keys.from_metadata(details.invocation_metadata) is not None:
            return handler
        return _refusal(handler)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` (its (de)serializers too) that aborts UNAUTHENTICATED."""

    async def refuse(request, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    serializers = {"request_deserializer": handler.request_deserializer,
                   "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, **serializers)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **serializers)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, **serializers)
    return grpc.unary_unary_rpc_method_handler(refuse, **serializers)


class GenerationServiceServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, generations: Generations, keys: ApiKeys | None = None) -> None:
        self.generations = generations
        self.keys = keys  # None: no API keys, every caller is tenant ""

    async def _tenant(self, context: grpc.aio.ServicerContext) -> str:
        """The caller's tenant. AuthInterceptor refuses a call without a known key before this runs; refusing here
        too keeps a servicer mounted without the interceptor from serving such a call as tenant ""."""
        if self.keys is None:
            return ""
        tenant = self.keys.from_metadata(context.invocation_metadata())
        if tenant is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
        return tenant.name

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        status: tuple[grpc.StatusCode, str] | None = None
        tenant = await self._tenant(context)
        try:
            async for event in self.generations.stream(request, context.invocation_metadata(), tenant=tenant):
                yield chunk_message(event) if isinstance(event, ChoiceDelta) else complete_message(event)
        except FAILURES as exc:
            status = _status(exc)
        if status is not None:
            await context.abort(*status)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        try:
            if not request.request_id:
                raise InvalidArgument("request_id: required")
            tenant = await self._tenant(context)
            return pb.AbortResponse(found=self.generations.abort(request.request_id, tenant=tenant))
        except FAILURES as exc:
            await context.abort(*_status(exc))

    async def Tokenize(self, request: pb.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        try:
            kind = request.WhichOneof("input")
            ids = await self.generations.tokenize(prompt=request.prompt if kind == "prompt" else None,
                                                  chat=request.chat if kind == "chat" else None,
                                                  tenant=await self._tenant(context))
            return pb.TokenizeResponse(token_ids=ids)
        except FAILURES as exc:
            await context.abort(*_status(exc))

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.GetModelInfoResponse:
        backend = self.generations.backend
        if backend is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "not ready: the engine is still loading")
        engine, limits = backend.engine, self.generations.model_limits
        # Off the event loop: a Ray pool asks its workers (each answer bounded by a short timeout).
        target_kv, draft_kv = await asyncio.to_thread(_kv_usages, engine)
        return pb.GetModelInfoResponse(
            target_model=backend.target_name,
            draft_model=backend.draft_name if engine.speculating else "",
            vocab_size=limits.vocab_size,
            max_k=limits.max_k,
            **_pool_sizes(engine),
            costs=_cost_model(engine),
            target_kv=target_kv,
            draft_kv=draft_kv,
            context_length=limits.context_window or 0,
            tokenizer=pb.TokenizerInfo(
                eos_token_ids=sorted(engine.eos_token_ids),
                chat_template=bool(getattr(backend.tokenizer, "chat_template", None)),
                max_prompt_tokens=self.generations.limits.max_prompt_tokens),
        )


def _cost_model(engine) -> pb.CostModel:
    costs = engine.costs
    return pb.CostModel(
        draft_step_seconds=costs.draft_step, draft_rows_seconds=dict(costs.draft_rows),
        forward_seconds=dict(costs.verify), acceptance_prior=engine.prior.value,
        draft_forward_seconds=dict(costs.draft_forward),
        batched=[pb.BatchedForward(rows=rows, width=width, seconds=seconds)
                 for (rows, width), seconds in sorted(costs.batched.items())])


def _kv_usages(engine) -> tuple[pb.KVUsage | None, pb.KVUsage | None]:
    """(target, draft) KV usage; the draft's is None when not speculating, either is None if it cannot be read."""
    return _kv_usage(engine.verifier), _kv_usage(engine.drafter) if engine.speculating else None


def _kv_usage(side) -> pb.KVUsage | None:
    try:
        usage = side.kv_usage()
    except Exception:  # only a report: the rest of the model info still answers
        log.warning("reading the KV usage of %s failed", type(side).__name__, exc_info=True)
        return None
    return pb.KVUsage(used_tokens=usage.used, reserved_tokens=usage.reserved, capacity_tokens=usage.capacity)


def _pool_sizes(engine) -> dict[str, int]:
    """Worker counts: the Ray pools' sizes, or one in-process model each."""
    return {"draft_workers": len(engine.drafter.worker_health()) if engine.speculating else 0,
            "target_replicas": len(engine.verifier.worker_health()),
            "tensor_parallel_size": engine.verifier.tensor_parallel()}
