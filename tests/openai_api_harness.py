"""What the tests of the OpenAI-compatible HTTP API (tests/test_openai_api_*.py) share: the tiny model's name, greedy
requests of a fixed length, a chat, the openai SDK's client of a server (no retries), the same request's answer over
gRPC, a check that a server went idle with its caches empty, and the SDK's error from a call that fails."""

from __future__ import annotations

import openai
import pytest

from gateway_harness import ServerThread
from tandem.client import TandemClient
from tandem.v1 import generation_pb2 as pb

MODEL = "tiny-target"
NEW_TOKENS = 24
GREEDY = {"temperature": 0.0, "max_tokens": NEW_TOKENS}
IGNORE_EOS = {"ignore_eos": True}
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def add(a, b):"}]


def _sdk(server: ServerThread) -> openai.OpenAI:
    # No retries: the SDK would retry a 429 or 503 on its own, hiding the status under test.
    return openai.OpenAI(base_url=f"{server.gateway.http_url}/v1", api_key="x", max_retries=0, timeout=60)


def _grpc(server: ServerThread, **request) -> tuple[str, list[int], pb.Complete]:
    with TandemClient(server.address, timeout=60) as client:
        items = list(client.generate(**request))
    chunks = [item for item in items if isinstance(item, pb.Chunk)]
    return "".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids], items[-1]


def _idle(server: ServerThread) -> bool:
    return server.wait_for(lambda: server.gateway.loop.active == 0 and server.caches_empty())


def _error(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    return caught.value
