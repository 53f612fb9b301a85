"""What the hardening and gRPC-keepalive tests share: a gateway over the tiny models named as the CLI names models
given by path, with a fault (a raise, a hold) run before each engine step; and a gRPC call's status code."""

from __future__ import annotations

import grpc

from tandem.core.config import EngineConfig, SpecConfig
from tandem.engines import Backend
from tandem.engines.local import build_engine
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc


def named_loader(target, draft, target_name: str, draft_name: str = "", fault=None):
    """A loader naming the models as the CLI does when given paths; `fault(engine)` runs before each step."""
    config = EngineConfig(spec=SpecConfig(adaptive=False, k_init=4), calibrate=False)

    def load() -> Backend:
        backend = Backend(build_engine(target, draft, config), target.tokenizer, target_name, draft_name)
        if fault is not None:
            engine, real_step = backend.engine, backend.engine.step

            def step():
                fault(engine)
                return real_step()

            engine.step = step
        return backend

    return load


def generation_stub(channel: grpc.Channel) -> generation_pb2_grpc.GenerationServiceStub:
    return generation_pb2_grpc.GenerationServiceStub(channel)


def status_of(call) -> tuple[grpc.StatusCode | None, str]:
    try:
        result = call()
        if not isinstance(result, pb.TokenizeResponse | pb.GetModelInfoResponse | bytes):
            list(result)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
