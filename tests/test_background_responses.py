"""Background responses (`background: true`): answered queued at once and generated on; polled with GET, streamed
again from any sequence number (`?stream=true&starting_after=N`), cancelled with POST .../cancel. Through the openai
SDK against a real gateway over the tiny pair (float32, greedy), and across two gateways over one real Redis: one runs
it, the other reads, streams and cancels it."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from gateway_harness import ServerThread, openai_sdk, tiny_backend
from tandem.gateway.openai import background, response_log
from tandem.sessions import EmbeddedRedis, open_session_store
from telemetry_helpers import scrape, value

MODEL = "tiny-target"
EVENTS = TypeAdapter(ResponseStreamEvent)
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
LONG = 3000  # output tokens of a response that is still running when the test cancels it
TERMINAL = ("completed", "incomplete", "failed", "cancelled")


def _finished(sdk: openai.OpenAI, response_id: str, timeout_s: float = 60) -> Response:
    deadline = time.monotonic() + timeout_s
    while (response := sdk.responses.retrieve(response_id)).status not in TERMINAL:
        assert time.monotonic() < deadline, f"{response_id} still {response.status}"
        time.sleep(0.05)
    return response


def _events(lines, until: int | None = None) -> list[dict]:
    """The data of an SSE body's events (the first `until` of them)."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            events.append(json.loads(line.removeprefix("data: ")))
            if until is not None and len(events) == until:
                break
    return events


def _idle(server: ServerThread, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while server.gateway.loop.active and time.monotonic() < deadline:
        time.sleep(0.02)
    return server.gateway.loop.active == 0


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


def test_another_gateway_reads_streams_and_cancels_a_background_response(tiny_models) -> None:
    """Over one real Redis: gateway `other` polls, streams again and cancels what `runner` runs (its runner sees the
    cancel flag); a response still running when its gateway stops is stored as failed."""
    target, draft, _ = tiny_models
    with EmbeddedRedis() as redis:
        runner, other = (ServerThread(tiny_backend(target, draft), http_port=0, sessions=open_session_store(redis.url))
                         for _ in range(2))
        try:
            ran, read = openai_sdk(runner), openai_sdk(other)
            short = ran.responses.create(model=MODEL, input="def add(a, b):", max_output_tokens=8, background=True,
                                         **GREEDY)
            done = _finished(read, short.id)
            replay = list(read.responses.retrieve(short.id, stream=True, starting_after=1))
            assert replay[0].sequence_number == 2 and replay[-1].response.model_dump() == done.model_dump()
            assert done.output_text == "".join(e.delta for e in replay if e.type == "response.output_text.delta")

            long = ran.responses.create(model=MODEL, input="def add(a, b):", max_output_tokens=LONG,
                                        background=True, **GREEDY)
            time.sleep(0.3)
            sent = time.monotonic()
            cancelled = read.responses.cancel(long.id)
            assert cancelled.status == "cancelled" and time.monotonic() - sent < 2.0  # the runner stopped it
            assert ran.responses.retrieve(long.id).status == "cancelled" and _idle(runner)

            orphan = ran.responses.create(model=MODEL, input="def add(a, b):", max_output_tokens=LONG,
                                          background=True, **GREEDY)
            time.sleep(0.3)
            runner.stop()
            failed = read.responses.retrieve(orphan.id)
            assert failed.status == "failed" and failed.error.code == "server_error"
        finally:
            for gateway in (runner, other):
                if gateway.thread.is_alive():  # (runner stopped already when the test got that far)
                    gateway.stop()


def test_a_response_whose_replica_stalled_past_its_lease_is_failed_and_stays_so(tiny_models, monkeypatch) -> None:
    """A replica whose event loop stops (as one that died) renews no lease: the other gateway then reports its
    response failed, and ends a reader's stream, instead of in_progress forever; when the stalled replica comes back
    its runner finds its lease gone and writes nothing over that."""
    monkeypatch.setattr(background, "HEARTBEAT_S", 0.25)
    monkeypatch.setattr(background, "LEASE_S", 4.0)  # long enough that the first read below comes within it, loaded
    target, draft, _ = tiny_models
    with EmbeddedRedis() as redis:
        runner, other = (ServerThread(tiny_backend(target, draft), http_port=0, sessions=open_session_store(redis.url))
                         for _ in range(2))
        try:
            started = openai_sdk(runner).responses.create(model=MODEL, input="def add(a, b):", max_output_tokens=LONG,
                                                    background=True, **GREEDY)
            time.sleep(0.5)
            runner.event_loop.call_soon_threadsafe(runner.event_loop.stop)
            runner.thread.join(10)
            read = openai_sdk(other)
            assert read.responses.retrieve(started.id).status == "in_progress"  # its lease still runs
            began = time.monotonic()
            replay = list(read.responses.retrieve(started.id, stream=True))  # ends once the lease is gone
            assert time.monotonic() - began < 8 and replay[0].type == "response.created"
            assert [event.type for event in replay[-2:]] == ["error", "response.failed"]  # as a runner ends one
            assert [event.sequence_number for event in replay] == list(range(len(replay)))
            lost = _finished(read, started.id)
            assert lost.status == "failed" and lost.error.code == "server_error" and "stopped" in lost.error.message
            assert replay[-1].response.model_dump() == lost.model_dump()
            streamed = "".join(event.delta for event in replay if event.type == "response.output_text.delta")
            assert streamed and lost.output_text == streamed  # what its log held, not what was stored at its start
            assert lost.output[0].status == "incomplete"
            again = list(read.responses.retrieve(started.id, stream=True, starting_after=len(replay) - 3))
            assert [event.type for event in again] == ["error", "response.failed"]
            runner.thread = threading.Thread(target=runner.event_loop.run_forever, daemon=True)
            runner.thread.start()  # back: its runner's next renewal finds the lease gone, and it stops
            assert _idle(runner)
            time.sleep(0.5)
            assert read.responses.retrieve(started.id).model_dump() == lost.model_dump()
        finally:
            for gateway in (runner, other):
                if not gateway.thread.is_alive():  # (failed while its loop was stopped: run it again to stop it)
                    gateway.thread = threading.Thread(target=gateway.event_loop.run_forever, daemon=True)
                    gateway.thread.start()
                gateway.stop()


def test_metrics_count_background_responses_running_and_ended(tiny_models) -> None:
    target, draft, _ = tiny_models
    gateway = ServerThread(tiny_backend(target, draft), http_port=0, metrics_port=0)
    try:
        sdk, url = openai_sdk(gateway), gateway.gateway.metrics_url
        families = scrape(url)  # every status from the start, at 0: absent series read as no data to an alert
        ended = {(name, labels["status"]): count for family in families.values() for name, labels, count in family
                 if name in ("tandem_responses_background_ended_total", "tandem_batches_ended_total")}
        assert ended == {(name, status): 0 for name, statuses in (
            ("tandem_responses_background_ended_total", ("completed", "incomplete", "failed", "cancelled")),
            ("tandem_batches_ended_total", ("completed", "failed", "expired", "cancelled"))) for status in statuses}
        running = sdk.responses.create(model=MODEL, input="def add(a, b):", max_output_tokens=LONG, background=True,
                                       **GREEDY)
        assert value(scrape(url), "tandem_responses_background_running") == 1
        sdk.responses.cancel(running.id)
        _finished(sdk, sdk.responses.create(model=MODEL, input="hi", max_output_tokens=2, background=True,
                                            **GREEDY).id)
        families = scrape(url)
        assert value(families, "tandem_responses_background_running") == 0
        assert value(families, "tandem_responses_background_ended_total", status="cancelled") == 1
        assert value(families, "tandem_responses_background_ended_total", status="incomplete") == 1
    finally:
        gateway.stop()


def test_a_background_response_running_past_the_ttl_stays_readable_and_cancellable(tiny_models) -> None:
    """It was stored at its start and end only: a run longer than --response-ttl was a 404 to poll, cancel and
    delete until it ended, and then came back."""
    target, draft, _ = tiny_models
    gateway = ServerThread(tiny_backend(target, draft), http_port=0, response_ttl_s=1.0)
    try:
        sdk = openai_sdk(gateway)
        started = sdk.responses.create(model=MODEL, input="def add(a, b):", max_output_tokens=LONG, background=True,
                                       **GREEDY)
        deadline = time.monotonic() + 3.0  # three TTLs
        while time.monotonic() < deadline:
            assert sdk.responses.retrieve(started.id).status in ("queued", "in_progress")
            time.sleep(0.1)
        assert sdk.responses.cancel(started.id).status == "cancelled"
        assert len(list(sdk.responses.retrieve(started.id, stream=True))) > 2  # its events too
    finally:
        gateway.stop()


def test_background_responses_wait_for_a_redis_connection_rather_than_fail(tiny_models, monkeypatch) -> None:
    """With its Redis connections all in use (readers blocked on XREAD, runners' heartbeats), a call raised at once:
    a runner whose lease was not taken was then taken for dead and its response failed ("the gateway replica running
    this background response stopped"), and readers' streams were cut. Here the pools hold two connections each."""
    monkeypatch.setattr(response_log, "CONTROL_CONNECTIONS", 2)
    monkeypatch.setattr(response_log, "READER_CONNECTIONS", 2)
    target, draft, _ = tiny_models
    with EmbeddedRedis() as redis:
        gateway = ServerThread(tiny_backend(target, draft), http_port=0, sessions=open_session_store(redis.url))
        try:
            sdk = openai_sdk(gateway)
            started = [sdk.responses.create(model=MODEL, input=f"x = {n}", max_output_tokens=64, background=True,
                                            **GREEDY) for n in range(6)]
            last: dict[str, str] = {}

            def read(response_id: str) -> None:
                last[response_id] = list(sdk.responses.retrieve(response_id, stream=True))[-1].type

            readers = [threading.Thread(target=read, args=(r.id,)) for r in started]
            for reader in readers:
                reader.start()
            for reader in readers:
                reader.join(120)
            assert all(_finished(sdk, r.id).status == "incomplete" for r in started)  # (cut at max_output_tokens)
            assert last == {r.id: "response.incomplete" for r in started}
        finally:
            gateway.stop()


def test_a_background_response_past_the_queue_is_refused_at_once(tiny_models) -> None:
    """It was answered queued and stored, then failed (rate_limit_exceeded) once it ran: the client had no 429 to
    retry on."""
    target, draft, _ = tiny_models
    gateway = ServerThread(tiny_backend(target, draft), http_port=0, max_requests=2)
    try:
        sdk = openai_sdk(gateway)
        running = [sdk.responses.create(model=MODEL, input=f"x = {n}", max_output_tokens=LONG, background=True,
                                        **GREEDY) for n in range(2)]
        with pytest.raises(openai.RateLimitError) as refused:
            sdk.responses.create(model=MODEL, input="one more", max_output_tokens=2, background=True)
        assert "queue full" in refused.value.body["message"] and refused.value.response.headers["retry-after"]
        assert all(sdk.responses.retrieve(r.id).status in ("queued", "in_progress") for r in running)
        for response in running:
            sdk.responses.cancel(response.id)
    finally:
        gateway.stop()
