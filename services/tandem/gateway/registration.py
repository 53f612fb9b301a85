"""Registering the servicer on a grpc.aio server: lenient deserializers (malformed bytes are INVALID_ARGUMENT),
handlers that never put an unexpected exception's text in a status, and the interceptor that asks for API keys."""

from __future__ import annotations

import logging

import grpc

from tandem.gateway.auth import ApiKeys
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc

log = logging.getLogger(__name__)

HEALTH_METHODS = "/grpc.health.v1.Health/"  # probes (kubelet, load balancers) carry no key: always open
UNAUTHENTICATED_MESSAGE = "missing or unknown API key: send `authorization: Bearer <key>` metadata"
MALFORMED = "request: the bytes are not a valid {} message"
INTERNAL_ERROR = "the server failed handling this request; the error is in its log"


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


def add_to_server(servicer: generation_pb2_grpc.GenerationServiceServicer, server: grpc.aio.Server) -> None:
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
