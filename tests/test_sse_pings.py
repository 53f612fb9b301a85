"""SSE pings on a real gateway (tiny models): an HTTP stream that sends nothing for a while sends comments, so that a
proxy that times out idle reads (nginx's proxy_read_timeout and AWS ALB's idle timeout, 60 s by default) keeps it.

A stream waits for its first event before its headers go, so that a refused request gets its own status; past a ping's
interval without it (a wait for a place, a long prefill on a CPU) the stream opens and pings, and a failure after that
travels as an event. Scaled down: pings every PING_S, one engine step held until the client has read two of them (at
most HELD_S: without pings, nothing reaches the client all that time).
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from gateway_harness import ServerThread
from hardening_harness import named_loader
from openai_api_harness import CHAT, GREEDY, IGNORE_EOS, MODEL, _sdk

HELD_S = 6.0
PING_S = 0.3
SDK_REQUEST = {"model": MODEL, "messages": CHAT, **GREEDY, "extra_body": IGNORE_EOS}
REQUEST = {"model": MODEL, "messages": CHAT, **GREEDY, **IGNORE_EOS}  # the raw body


class HeldGateway:
    """A gateway whose engine, once armed, holds the `at_step`-th step it takes with a request until the client has
    read two pings (at most `hold_s`); `fail`: that step then raises."""

    def __init__(self, tiny_models, ping_s: float) -> None:
        target, draft, _ = tiny_models
        self.pinged = threading.Event()
        self.released: bool | None = None
        self._armed: dict | None = None

        def hold(engine) -> None:
            armed = self._armed
            if armed is None or not engine.sequences:
                return
            armed["steps"] += 1
            if armed["steps"] == armed["at_step"]:
                self._armed = None
                self.released = self.pinged.wait(armed["hold_s"])
                if armed["fail"]:
                    raise RuntimeError("a planted engine failure")

        self.server = ServerThread(named_loader(target, draft, "tiny-target", "tiny-draft", hold), http_port=0,
                                   sse_ping_s=ping_s)

    def arm(self, at_step: int = 1, hold_s: float = HELD_S, fail: bool = False) -> None:
        self.pinged.clear()
        self.released = None
        self._armed = {"steps": 0, "at_step": at_step, "hold_s": hold_s, "fail": fail}

    def stream(self, path: str, body: dict) -> tuple[int, list[str]]:
        """The status and the stream's lines (blank lines left out), two pings read signalled to the engine."""
        lines = []
        with httpx.stream("POST", f"{self.server.gateway.http_url}{path}", json=body, timeout=30) as response:
            for line in response.iter_lines():
                if line:
                    lines.append(line)
                if sum(seen.startswith(":") for seen in lines) == 2:
                    self.pinged.set()
            return response.status_code, lines


@pytest.fixture
def held(tiny_models):
    made = []

    def make(ping_s: float) -> HeldGateway:
        made.append(HeldGateway(tiny_models, ping_s))
        return made[-1]

    yield make
    for gateway in made:
        gateway.server.stop()


def _text(lines: list[str]) -> str:
    chunks = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: {")]
    return "".join(choice["delta"].get("content") or "" for chunk in chunks for choice in chunk["choices"])


def test_a_stream_waiting_for_its_first_token_opens_and_pings(held) -> None:
    """The headers and two pings reach the client while the engine holds the request's first step; the stream then
    carries the same text as the whole response."""
    gateway = held(PING_S)
    expected = _sdk(gateway.server).chat.completions.create(**SDK_REQUEST).choices[0].message.content
    gateway.arm()
    status, lines = gateway.stream("/v1/chat/completions", {**REQUEST, "stream": True})
    assert gateway.released is True
    # the assistant's role (a chat stream's opening chunk, no event needed), then the pings, then the text
    assert status == 200 and lines[1:3] == [": ping", ": ping"] and lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][len("data: "):])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert _text(lines) == expected


def test_without_pings_nothing_reaches_the_client_while_it_waits(held) -> None:
    """The control (--sse-ping 0): the client reads nothing, not even the headers, for all of the hold."""
    gateway = held(0.0)
    gateway.arm()
    status, lines = gateway.stream("/v1/chat/completions", {**REQUEST, "stream": True})
    assert gateway.released is False
    assert status == 200 and not any(line.startswith(":") for line in lines) and lines[-1] == "data: [DONE]"


def test_a_stream_silent_between_tokens_pings(held) -> None:
    """A step held after tokens have gone (the request's third): pings between them, the text whole."""
    gateway = held(PING_S)
    expected = _sdk(gateway.server).chat.completions.create(**SDK_REQUEST).choices[0].message.content
    gateway.arm(at_step=3)
    status, lines = gateway.stream("/v1/chat/completions", {**REQUEST, "stream": True})
    assert gateway.released is True and status == 200
    first_ping = lines.index(": ping")
    assert any(line.startswith("data: {") for line in lines[:first_ping])
    assert any(line.startswith("data: {") for line in lines[first_ping + 2:])
    assert _text(lines) == expected


def test_a_failure_after_the_stream_opened_travels_as_an_event(held) -> None:
    """The status went with the headers (200); the engine's failure then comes as OpenAI's error event and [DONE],
    which the SDKs raise."""
    gateway = held(PING_S)
    gateway.arm(fail=True)
    status, lines = gateway.stream("/v1/chat/completions", {**REQUEST, "stream": True})
    assert gateway.released is True and status == 200 and lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][len("data: "):])
    assert set(error) == {"error"} and error["error"]["message"]


def test_the_sdk_streams_through_pings(held) -> None:
    """The openai SDK reads a pinged chat stream and a pinged Responses API stream (response.created first, then
    the text, the end as the whole response's) as it reads unpinged ones: the same text as the whole responses.
    Each stream's first step is held 1.5 s (no raw reader signals the pings here): about four pings."""
    gateway = held(PING_S)
    sdk = _sdk(gateway.server)
    whole = sdk.chat.completions.create(**SDK_REQUEST).choices[0].message.content
    gateway.arm(hold_s=1.5)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       sdk.chat.completions.create(**SDK_REQUEST, stream=True) if chunk.choices)
    assert gateway.released is False and streamed == whole
    request = {"model": MODEL, "input": "def add(a, b):", "temperature": 0.0, "max_output_tokens": 16}
    expected = sdk.responses.create(**request)
    gateway.arm(hold_s=1.5)
    events = list(sdk.responses.create(**request, stream=True))
    assert gateway.released is False and events[0].type == "response.created"
    assert events[-1].type == f"response.{expected.status}"  # incomplete: max_output_tokens reached
    assert events[-1].response.output_text == expected.output_text
