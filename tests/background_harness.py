"""What the background-response tests share: the tiny target's name, greedy sampling, a response long enough to be
still running when a test cancels it, waits for a response to end and for a gateway to go idle, and two gateways over
one Redis."""

from __future__ import annotations

import time

import openai
from openai.types.responses import Response

from gateway_harness import ServerThread, polled, tiny_backend
from tandem.sessions import open_session_store

MODEL = "tiny-target"
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
LONG = 3000  # output tokens of a response that is still running when the test cancels it
TERMINAL = ("completed", "incomplete", "failed", "cancelled")


def _finished(sdk: openai.OpenAI, response_id: str, timeout_s: float = 60) -> Response:
    deadline = time.monotonic() + timeout_s
    while (response := polled(lambda: sdk.responses.retrieve(response_id))).status not in TERMINAL:
        assert time.monotonic() < deadline, f"{response_id} still {response.status}"
        time.sleep(0.05)
    return response


def _idle(server: ServerThread, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while server.gateway.loop.active and time.monotonic() < deadline:
        time.sleep(0.02)
    return server.gateway.loop.active == 0


def two_gateways(tiny_models, redis) -> tuple[ServerThread, ServerThread]:
    """A gateway that runs background responses and another that reads them, over one Redis; they share the tiny pair's
    model objects, so only the first may generate."""
    target, draft, _ = tiny_models
    runner, other = (ServerThread(tiny_backend(target, draft), http_port=0, sessions=open_session_store(redis.url))
                     for _ in range(2))
    return runner, other
