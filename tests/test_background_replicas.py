"""Background responses (`background: true`) on gateways each test runs of its own, over the tiny pair (float32,
greedy): across two gateways over one real Redis, one runs a response while the other reads, streams and cancels it,
and a replica stalled past its lease has its response failed; metrics count them; one running past --response-ttl
stays readable; runners and readers wait for a Redis connection; one past the queue is refused at once. (The
single-gateway tests are in tests/test_background_responses.py.)"""

from __future__ import annotations

import threading
import time

import openai
import pytest

from background_harness import GREEDY, LONG, MODEL, _finished, _idle, two_gateways
from gateway_harness import ServerThread, openai_sdk, tiny_backend
from tandem.gateway.openai import background, response_log, stored
from tandem.sessions import EmbeddedRedis, open_session_store
from telemetry_helpers import scrape, value


def test_another_gateway_reads_streams_and_cancels_a_background_response(tiny_models) -> None:
    """Over one real Redis: gateway `other` polls, streams again and cancels what `runner` runs (its runner sees the
    cancel flag); a response still running when its gateway stops is stored as failed."""
    with EmbeddedRedis() as redis:
        runner, other = two_gateways(tiny_models, redis)
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


def test_a_response_ending_as_its_gateway_stops_is_stored_failed_before_the_store_closes(tiny_models,
                                                                                         monkeypatch) -> None:
    """A gateway stopping ends its requests, so a background response's runner begins storing its last state; when
    that store was slow (a loaded machine), the shutdown's cancel interrupted the wait, the store closed under the
    write, and another replica read the response in_progress. Here every store of an ended response takes 1 s."""
    slow_put = stored.ResponseStore._put

    def put(self, tenant, response, new):
        if response.response["status"] not in ("queued", "in_progress"):
            time.sleep(1.0)
        slow_put(self, tenant, response, new)

    monkeypatch.setattr(stored.ResponseStore, "_put", put)
    with EmbeddedRedis() as redis:
        runner, other = two_gateways(tiny_models, redis)
        try:
            orphan = openai_sdk(runner).responses.create(model=MODEL, input="def add(a, b):", max_output_tokens=LONG,
                                                         background=True, **GREEDY)
            time.sleep(0.3)
            runner.stop()
            failed = openai_sdk(other).responses.retrieve(orphan.id)
            assert failed.status == "failed" and failed.error.code == "server_error", failed.status
        finally:
            for gateway in (runner, other):
                if gateway.thread.is_alive():
                    gateway.stop()


def test_a_response_whose_replica_stalled_past_its_lease_is_failed_and_stays_so(tiny_models, monkeypatch) -> None:
    """A replica whose event loop stops (as one that died) renews no lease: the other gateway then reports its
    response failed, and ends a reader's stream, instead of in_progress forever; when the stalled replica comes back
    its runner finds its lease gone and writes nothing over that."""
    monkeypatch.setattr(background, "HEARTBEAT_S", 0.25)
    monkeypatch.setattr(background, "LEASE_S", 4.0)  # long enough that the first read below comes within it, loaded
    with EmbeddedRedis() as redis:
        runner, other = two_gateways(tiny_models, redis)
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
