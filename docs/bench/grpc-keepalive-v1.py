"""A gRPC client that sends keepalive pings, during a stream that sends nothing for a while (a long prefill on a CPU,
a request waiting for a place): does the gateway let its stream through?

gRPC's server defaults take a client ping more often than every 5 minutes while the server sends nothing as abuse:
after two such pings the server sends GOAWAY too_many_pings and the client's streams on that connection fail
(UNAVAILABLE). Production clients commonly ping every 10-30 s so that a proxy or NAT keeps the connection; a prefill of
a minute or more on a CPU then fails. This serves the tiny pair with one engine step held for `silent` seconds before
the first token, and sends one request from a client pinging every `ping` seconds (10 s: grpc-java's floor).

    PYTHONPATH=services python docs/bench/grpc-keepalive-v1.py out.json [silent_s ping_s]
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

import grpc
import torch

from gateway_harness import ServerThread
from hardening_harness import named_loader
from tandem.gateway.options import GatewayOptions
from tandem.models.loader import load_model
from tandem.models.tiny import make_tiny
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc


def main() -> None:
    path = sys.argv[1]
    silent_s = float(sys.argv[2]) if len(sys.argv) > 2 else 100.0
    ping_s = float(sys.argv[3]) if len(sys.argv) > 3 else 10.0
    with tempfile.TemporaryDirectory() as tmp:
        tiny = make_tiny(Path(tmp) / "tiny", seed=0)
        target, draft = (load_model(str(p), device=torch.device("cpu"), dtype=torch.float32)
                         for p in (tiny.target, tiny.draft))
        results = {}
        for name, options in SETTINGS.items():
            results[name] = one_request(target, draft, silent_s, ping_s, options)
            print(name, results[name], flush=True)
    Path(path).write_text(json.dumps({"silent_s": silent_s, "client_ping_s": ping_s, "results": results}, indent=1)
                          + "\n")


# gRPC's own defaults (the gateway gives no keepalive option: as before 958b580) let a client ping at most every
# 5 minutes while the server sends nothing; tandem's are GatewayOptions.grpc_keepalive().
SETTINGS = {"gRPC's defaults": {"grpc_keepalive": False}, "tandem's default": {}}


def one_request(target, draft, silent_s: float, ping_s: float, settings: dict) -> dict:
    held = {"done": False}

    def hold(engine) -> None:  # before the step that would prefill: nothing streams meanwhile
        if engine.sequences and not held["done"]:
            held["done"] = True
            time.sleep(silent_s)

    keepalive = GatewayOptions.grpc_keepalive
    if not settings.get("grpc_keepalive", True):
        GatewayOptions.grpc_keepalive = lambda self: []
    try:
        server = ServerThread(named_loader(target, draft, "tiny-target", "tiny-draft", hold),
                              stall_timeout=silent_s + 60)
    finally:
        GatewayOptions.grpc_keepalive = keepalive
    options = [("grpc.keepalive_time_ms", int(ping_s * 1000)), ("grpc.keepalive_timeout_ms", 20000),
               ("grpc.http2.max_pings_without_data", 0)]
    started = time.monotonic()
    try:
        with grpc.insecure_channel(server.address, options=options) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), ignore_eos=True,
                                         sampling=pb.SamplingParams(max_tokens=4))
            try:
                replies = list(stub.Generate(request, timeout=silent_s + 60))
                result = {"status": "OK", "completion_tokens": replies[-1].complete.usage.completion_tokens}
            except grpc.RpcError as exc:
                result = {"status": exc.code().name, "details": exc.details()}
    finally:
        server.stop()
    return result | {"seconds": round(time.monotonic() - started, 1)}


if __name__ == "__main__":
    main()
