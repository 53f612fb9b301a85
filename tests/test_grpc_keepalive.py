"""gRPC keepalive on a real gateway (tiny models): a client that pings while its stream sends nothing keeps it.

Production gRPC clients ping every 10-30 s so that proxies and NATs keep their connections. Under gRPC's own server
default a client may ping at most every 5 minutes while the server sends nothing; past two such pings the server sent
GOAWAY too_many_pings and the stream failed UNAVAILABLE: a prefill of a minute or more on a CPU, or a wait for a place,
failed so for a client pinging every 10 s (docs/bench/grpc-keepalive-v1.json). Here the intervals are scaled down: a
client pinging every second while one engine step is held 4 s.
"""

from __future__ import annotations

import time

import grpc
import pytest

from gateway_harness import ServerThread
from hardening_harness import named_loader
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc

HELD_S = 4.0
CLIENT = [("grpc.keepalive_time_ms", 1000), ("grpc.keepalive_timeout_ms", 10000),
          ("grpc.http2.max_pings_without_data", 0)]


def _silent_stream(tiny_models, **options) -> grpc.StatusCode:
    """The status of one request from a client pinging every second, its first step held HELD_S seconds."""
    target, draft, _ = tiny_models
    held = {"done": False}

    def hold(engine) -> None:
        if engine.sequences and not held["done"]:
            held["done"] = True
            time.sleep(HELD_S)

    server = ServerThread(named_loader(target, draft, "tiny-target", "tiny-draft", hold), **options)
    try:
        with grpc.insecure_channel(server.address, options=CLIENT) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), ignore_eos=True,
                                         sampling=pb.SamplingParams(max_tokens=4))
            try:
                replies = list(stub.Generate(request, timeout=60))
            except grpc.RpcError as exc:
                return exc.code()
            assert replies[-1].complete.usage.completion_tokens == 4
            return grpc.StatusCode.OK
    finally:
        server.stop()


@pytest.mark.parametrize(("client_ping_s", "status"), [
    (0.5, grpc.StatusCode.OK),  # the gateway's setting, scaled as the client is
    (300.0, grpc.StatusCode.UNAVAILABLE),  # gRPC's own default: the client's pings count as abuse (the control)
])
def test_a_client_pinging_through_a_silent_stream_keeps_it(tiny_models, client_ping_s, status) -> None:
    assert _silent_stream(tiny_models, grpc_client_ping_s=client_ping_s) == status
