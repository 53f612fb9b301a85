"""Background responses (`background: true`): answered queued at once and generated on; polled with GET, streamed
again from any sequence number (`?stream=true&starting_after=N`), cancelled with POST .../cancel. Through the openai
SDK against a real gateway over the tiny pair (float32, greedy). Tests that run gateways of their own (two over one
real Redis: one runs it, the other reads, streams and cancels it; a stalled replica's lease, metrics, the TTL, Redis
connections, the queue) are in tests/test_background_replicas.py."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from background_harness import GREEDY, LONG, MODEL, _finished, _idle
from gateway_harness import openai_sdk

EVENTS = TypeAdapter(ResponseStreamEvent)


def _events(lines, until: int | None = None) -> list[dict]:
    """The data of an SSE body's events (the first `until` of them)."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            events.append(json.loads(line.removeprefix("data: ")))
            if until is not None and len(events) == until:
                break
    return events


def test_a_background_response_is_queued_at_once_and_finishes_as_the_same_response(server) -> None:
    sdk = openai_sdk(server)
    started = sdk.responses.create(model=MODEL, input="def add(a, b):", max_output_tokens=12, background=True,
                                   **GREEDY)
    assert started.background is True and started.status in ("queued", "in_progress") and started.output == []
    done = _finished(sdk, started.id)
    plain = sdk.responses.create(model=MODEL, input="def add(a, b):", max_output_tokens=12, store=False, **GREEDY)
    assert done.status == plain.status == "incomplete" and done.background is True
    assert done.output_text == plain.output_text and done.usage.output_tokens == 12
    assert done.usage.input_tokens == plain.usage.input_tokens
    Response.model_validate(done.model_dump(), strict=True)
    continued = sdk.responses.create(model=MODEL, previous_response_id=done.id, input="Again.", max_output_tokens=2,
                                     **GREEDY)
    assert continued.usage.input_tokens > done.usage.input_tokens + done.usage.output_tokens


def test_a_background_stream_is_read_again_from_any_sequence_number(server) -> None:
    """A client that drops the stream after a few events reads the rest with starting_after: together, every event
    once, in order, ending with response.incomplete; the SDK reads the same replay as its own event types."""
    url = f"{server.gateway.http_url}/v1/responses"
    body = {"model": MODEL, "input": "def add(a, b):", "max_output_tokens": 10, "temperature": 0,
            "ignore_eos": True, "background": True, "stream": True}
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        assert response.status_code == 200
        head = _events(response.iter_lines(), until=4)
    assert [event["type"] for event in head[:2]] == ["response.created", "response.queued"]
    response_id = head[0]["response"]["id"]
    with httpx.stream("GET", f"{url}/{response_id}", params={"stream": "true", "starting_after": 3},
                      timeout=60) as rest:
        assert rest.status_code == 200 and rest.headers["content-type"].startswith("text/event-stream")
        tail = _events(rest.iter_lines())
    events = head + tail
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["background"] is True
    text = "".join(event["delta"] for event in events if event["type"] == "response.output_text.delta")
    assert text == events[-1]["response"]["output"][0]["content"][0]["text"]
    sdk = openai_sdk(server)
    replayed = list(sdk.responses.retrieve(response_id, stream=True, starting_after=len(events) - 3))
    assert [event.sequence_number for event in replayed] == list(range(len(events) - 2, len(events)))
    assert replayed[-1].response.model_dump() == _finished(sdk, response_id).model_dump()
    for event in events:
        EVENTS.validate_python(event)


def test_cancel_stops_a_background_response_and_frees_its_caches(server) -> None:
    sdk = openai_sdk(server)
    started = sdk.responses.create(model=MODEL, input="def add(a, b):", max_output_tokens=LONG, background=True,
                                   **GREEDY)
    time.sleep(0.3)
    cancelled = sdk.responses.cancel(started.id)
    assert cancelled.status == "cancelled" and cancelled.background is True
    assert sum(len(part.text) for item in cancelled.output for part in item.content) > 0 and cancelled.usage is None
    assert all(item.status == "incomplete" for item in cancelled.output)
    assert _idle(server)
    assert sdk.responses.cancel(started.id).model_dump() == cancelled.model_dump()  # idempotent
    assert sdk.responses.retrieve(started.id).model_dump() == cancelled.model_dump()
    replay = list(sdk.responses.retrieve(started.id, stream=True))  # the stream just ends (no event says cancelled)
    assert replay[0].type == "response.created" and replay[-1].type != "response.completed"
    done = sdk.responses.create(model=MODEL, input="hi", max_output_tokens=2, background=True, **GREEDY)
    assert sdk.responses.cancel(_finished(sdk, done.id).id).status == "incomplete"  # finished: as it is


def test_a_running_background_response_cannot_be_continued_yet(server) -> None:
    """Its stored conversation has no output yet: continuing it would answer the input without the reply."""
    sdk = openai_sdk(server)
    started = sdk.responses.create(model=MODEL, input="def add(a, b):", max_output_tokens=LONG, background=True,
                                   **GREEDY)
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.responses.create(model=MODEL, input="and now?", previous_response_id=started.id, max_output_tokens=2)
    assert refused.value.body["param"] == "previous_response_id" and "still" in refused.value.body["message"]
    sdk.responses.cancel(started.id)
    assert _idle(server)
    follow = sdk.responses.create(model=MODEL, input="and now?", previous_response_id=started.id, max_output_tokens=2)
    assert follow.previous_response_id == started.id and follow.output  # a cancelled one goes on from what it had
    assert (follow.status, follow.incomplete_details.reason) == ("incomplete", "max_output_tokens")


def test_deleting_a_running_background_response_stops_it_for_good(server) -> None:
    """DELETE answered deleted while the run went on: the engine stayed busy, and the runner stored the response
    again, whole, a few seconds later."""
    sdk = openai_sdk(server)
    started = sdk.responses.create(model=MODEL, input="def add(a, b):", max_output_tokens=LONG, background=True,
                                   **GREEDY)
    time.sleep(0.3)
    assert sdk.responses.delete(started.id) is None  # the SDK's delete returns nothing on success
    assert _idle(server)  # stopped, not left generating
    time.sleep(1.5)  # past the runner's heartbeat and its last store, had it gone on
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(started.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.delete(started.id)


def test_an_id_in_use_is_refused_and_the_response_holding_it_goes_on(server) -> None:
    """A client's request_id names one response: a second background response sent with it while the first runs
    (or a synchronous one after it) is a 400 that leaves the first as it was, still running and cancellable."""
    sdk = openai_sdk(server)
    first = sdk.responses.create(model=MODEL, input="first", max_output_tokens=LONG, background=True,
                                 extra_body={"ignore_eos": True, "request_id": "resp_taken"}, temperature=0)
    for in_background in (True, False):
        with pytest.raises(openai.BadRequestError) as taken:
            sdk.responses.create(model=MODEL, input="second", max_output_tokens=2, background=in_background,
                                 extra_body={"request_id": "resp_taken"})
        assert taken.value.body["param"] == "request_id" and taken.value.body["code"] == "response_id_in_use"
    assert sdk.responses.retrieve(first.id).status in ("queued", "in_progress")
    assert [item.content[0].text for item in sdk.responses.input_items.list(first.id).data] == ["first"]
    assert sdk.responses.cancel(first.id).status == "cancelled"
    assert _idle(server)
    with pytest.raises(openai.BadRequestError):  # ended: the id still names it
        sdk.responses.create(model=MODEL, input="third", max_output_tokens=2, extra_body={"request_id": first.id})
    assert sdk.responses.retrieve(first.id).status == "cancelled"


def test_a_running_synchronous_response_holds_its_id_and_gives_it_up_unstored(server) -> None:
    """A synchronous response was only checked for a free id at its start and stored over whatever held the id at
    its end: a background response sent meanwhile with the same id was answered queued, then overwritten."""
    sdk = openai_sdk(server)
    url = f"{server.gateway.http_url}/v1/responses"
    body = {"model": MODEL, "input": "first", "max_output_tokens": LONG, "stream": True, "temperature": 0,
            "ignore_eos": True, "request_id": "resp_sync"}
    with httpx.stream("POST", url, json=body, timeout=60) as streaming:
        lines = streaming.iter_lines()  # (kept: an iterator dropped closes the connection)
        assert _events(lines, until=3)[0]["type"] == "response.created"
        with pytest.raises(openai.BadRequestError) as taken:
            sdk.responses.create(model=MODEL, input="second", max_output_tokens=2, background=True,
                                 extra_body={"request_id": "resp_sync"})
        assert taken.value.body["code"] == "response_id_in_use"
        assert sdk.responses.retrieve("resp_sync").status in ("queued", "in_progress")
    assert _idle(server)  # the client left: the response ends unstored and its id is free again
    deadline = time.monotonic() + 10
    while True:  # (given up as the stream closes, just after the engine lets the request go)
        try:
            sdk.responses.retrieve("resp_sync")
        except openai.NotFoundError:
            break
        assert time.monotonic() < deadline, "the id was never given up"
        time.sleep(0.05)
    done = sdk.responses.create(model=MODEL, input="again", max_output_tokens=2, extra_body={"request_id": "resp_sync"})
    assert sdk.responses.retrieve("resp_sync").model_dump() == done.model_dump()


def test_what_cannot_run_in_the_background_is_refused(server) -> None:
    sdk = openai_sdk(server)
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.responses.create(model=MODEL, input="hi", max_output_tokens=2, background=True, store=False)
    assert refused.value.body["param"] == "background"
    synchronous = sdk.responses.create(model=MODEL, input="hi", max_output_tokens=2, **GREEDY)
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
        sdk.responses.cancel(synchronous.id)
    with pytest.raises(openai.BadRequestError):
        list(sdk.responses.retrieve(synchronous.id, stream=True))
    for unknown in (lambda: sdk.responses.cancel("resp_nothing"),
                    lambda: list(sdk.responses.retrieve("resp_nothing", stream=True))):
        with pytest.raises(openai.NotFoundError):
            unknown()
    with pytest.raises(openai.BadRequestError) as too_long:  # past max_prompt_tokens: refused before it is queued
        sdk.responses.create(model=MODEL, input="x " * 3000, max_output_tokens=2, background=True,
                             extra_body={"request_id": "resp_too_long"})
    assert too_long.value.body["param"] == "input"
    with pytest.raises(openai.NotFoundError):  # nothing kept of it
        sdk.responses.retrieve("resp_too_long")
