"""What the loadtest modules that run against a real gateway (tests/test_loadtest_grpc_runs.py,
tests/test_loadtest_openai_backend.py) share: the tokens a request asks for, a tiny-model gateway on loopback serving
gRPC and the HTTP API, one a module, a run's configuration against it, and running one."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway_harness import ServerThread, tiny_backend
from loadtest.client_run import Driver
from loadtest.config import RunConfig
from loadtest.trace import RunTrace
from tandem.sessions import MemorySessionStore

MAX_TOKENS = 8


# The fixture every module run against a gateway takes, one instance a module: a module imports it by this name
# (pytest finds a fixture by the name it is given; the import keeps ruff from reading the test arguments as
# redefinitions).
@pytest.fixture(scope="module", name="server")
def server_fixture(tiny_models):
    target, draft, _ = tiny_models
    running = ServerThread(tiny_backend(target, draft), sessions=MemorySessionStore(), http_port=0)  # gRPC and HTTP
    yield running
    running.stop()


def _config(server, **options) -> RunConfig:
    return RunConfig(**({"address": server.address, "requests": 4, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                         "lengths": ("short",), "seed": 1} | options))


def _run(config: RunConfig) -> tuple[RunTrace, float]:
    started = time.monotonic()
    trace = asyncio.run(Driver(config).run())
    return trace, time.monotonic() - started
