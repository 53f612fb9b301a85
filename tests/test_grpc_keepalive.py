"""gRPC keepalive on a real gateway (tiny models): a client that pings while its stream sends nothing keeps it, and
a client that stops answering the gateway's pings has its request ended.

Production gRPC clients ping every 10-30 s so that proxies and NATs keep their connections. Under gRPC's own server
default a client may ping at most every 5 minutes while the server sends nothing; past two such pings the server sent
GOAWAY too_many_pings and the stream failed UNAVAILABLE: a prefill of a minute or more on a CPU, or a wait for a place,
failed so for a client pinging every 10 s (docs/bench/grpc-keepalive-v1.json). Here the intervals are scaled down: a
client pinging every second while one engine step is held 8 s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

from gateway_harness import ServerThread
from hardening_harness import named_loader
from tandem.gateway import options as gateway_options
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc

HELD_S = 8.0
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


@pytest.mark.parametrize("grpc_defaults", [False, True])
def test_a_client_pinging_through_a_silent_stream_keeps_it(tiny_models, monkeypatch, grpc_defaults) -> None:
    """The gateway's settings, scaled as the client is; and, as the control, gRPC's own (none given), under which the
    client's pings count as abuse and its stream fails."""
    if grpc_defaults:
        monkeypatch.setattr(gateway_options.GatewayOptions, "grpc_keepalive", lambda self: [])
    status = _silent_stream(tiny_models, grpc_client_ping_s=0.5)
    assert status == (grpc.StatusCode.UNAVAILABLE if grpc_defaults else grpc.StatusCode.OK)


# A client in a process of its own that starts a long stream, says so after its first message, then reads on.
CLIENT_PROCESS = """
import sys, grpc
from tandem.v1 import generation_pb2 as pb, generation_pb2_grpc
with grpc.insecure_channel(sys.argv[1]) as channel:
    stream = generation_pb2_grpc.GenerationServiceStub(channel).Generate(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[1, 2, 3]), ignore_eos=True, sampling=pb.SamplingParams(max_tokens=3000)))
    for index, _ in enumerate(stream):
        if index == 0:
            print("started", flush=True)
"""


@pytest.mark.parametrize(("keepalive_s", "ended"), [(1.0, True), (600.0, False)])
def test_a_client_that_stops_answering_has_its_request_ended(tiny_models, monkeypatch, keepalive_s, ended) -> None:
    """A client gone without closing its connection (a crashed host, a dropped NAT entry; here a stopped process,
    whose kernel still acknowledges the bytes) answers no ping: the gateway's keepalive closes its connection and its
    request ends, freeing its place and caches, rather than generating on into a connection no one reads. Scaled:
    pings every second, 2 s to answer; without the gateway's pings (600 s) the request is still running."""
    monkeypatch.setattr(gateway_options, "KEEPALIVE_TIMEOUT_S", 2.0)
    target, draft, _ = tiny_models
    server = ServerThread(named_loader(target, draft, "tiny-target", "tiny-draft", lambda _: time.sleep(0.02)),
                          grpc_keepalive_s=keepalive_s)
    client = subprocess.Popen([sys.executable, "-c", CLIENT_PROCESS, server.address], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert client.stdout.readline().strip() == "started"
        os.kill(client.pid, signal.SIGSTOP)
        assert server.wait_for(lambda: not server.engine.sequences, timeout=10) == ended
    finally:
        client.kill()
        client.wait()
        server.stop()
