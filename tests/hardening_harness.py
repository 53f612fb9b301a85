"""What the hardening and gRPC-keepalive tests share: a gateway over the tiny models named as the CLI names models
given by path, with a fault (a raise, a hold) run before each engine step; a gRPC call's status code; and the
longest wait between a gateway's health answers while a request of a client's own runs."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

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


def longest_between_health_answers(address: str, request: Callable[[], object]) -> tuple[float, object]:
    """(the longest time between two answers of the gateway's readiness health check at `address`, asked every 20 ms
    while `request()` runs in a thread, its result). The 20 ms sleep counts, so that a hold of the process that
    begins while this client sleeps is seen too."""
    from tandem.gateway.server import READINESS_SERVICE

    result: dict = {}
    running = threading.Thread(target=lambda: result.update(value=request()))
    answers = []
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        running.start()
        while running.is_alive():
            health.Check(health_pb2.HealthCheckRequest(service=READINESS_SERVICE), timeout=60)
            answers.append(time.monotonic())
            time.sleep(0.02)
    running.join()
    return max((b - a for a, b in itertools.pairwise(answers)), default=0.0), result["value"]
