"""The Batch API across two gateways over one real Redis, over the tiny pair (float32, greedy): one runs a batch
while the other reads, lists and cancels it, and a batch whose replica shut down or died is taken on by the other,
which answers each request not yet answered, every custom_id once in the files; a gateway that runs no batches leaves
them to one that does; and a tenant's files are bounded in bytes. (The single-gateway tests are in
tests/test_batches.py.)"""

from __future__ import annotations

import threading
import time

import openai
import pytest

from batches_harness import _chat, _ended, _lines, _upload
from gateway_harness import ServerThread, openai_sdk, tiny_backend
from tandem.gateway.openai import batch_run, batches
from tandem.sessions import EmbeddedRedis, open_session_store
from telemetry_helpers import scrape, value


def _two_gateways(tiny_models, redis, **first) -> list[ServerThread]:
    """Two gateways over one Redis; `first`: the first one's other options. Each has models of its own, as two
    replicas do: their engines run forwards at the same time (one model's forward is not safe to run twice at once)."""
    import torch

    from tandem.models.loader import load_model

    target, draft, _ = tiny_models
    own = [load_model(str(model.path), device=torch.device("cpu"), dtype=torch.float32, progress=False)
           for model in (target, draft)]
    return [ServerThread(tiny_backend(*pair), http_port=0, sessions=open_session_store(redis.url), metrics_port=0,
                         **(first if index == 0 else {})) for index, pair in enumerate([(target, draft), own])]


def _stop(*gateways: ServerThread) -> None:
    for gateway in gateways:
        if gateway.thread.is_alive():  # (a test stopped some already)
            gateway.stop()


def _long_batch(sdk: openai.OpenAI, tag: str, count: int = 16):
    lines = [_chat(f"{tag}{n}", f"x = {n}", 400) for n in range(count)]
    return sdk.batches.create(input_file_id=_upload(sdk, lines), endpoint="/v1/chat/completions",
                              completion_window="24h")


def _answered_once(sdk: openai.OpenAI, batch, tag: str, count: int = 16) -> bool:
    lines = _lines(sdk, batch.output_file_id)
    return sorted(lines) == sorted(f"{tag}{n}" for n in range(count)) and batch.request_counts.completed == count


def _short_leases(monkeypatch) -> None:
    """A run's lease renewed every 0.2 s, run out after 1.5 s; replicas look for batches nobody holds every 0.3 s."""
    monkeypatch.setattr(batch_run, "HEARTBEAT_S", 0.2)
    monkeypatch.setattr(batch_run, "LEASE_S", 1.5)
    monkeypatch.setattr(batches, "SWEEP_S", 0.3)


def _answering(sdk: openai.OpenAI, batch_id: str, answered: int = 2) -> None:
    """Wait until the batch has `answered` requests answered (of its 16: it is then mid-run)."""
    deadline = time.monotonic() + 30
    while sdk.batches.retrieve(batch_id).request_counts.completed < answered:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def _ended_count(gateway: ServerThread, status: str) -> float:
    """Batches the gateway's runs ended so, as its metrics say: counted as a run stores the batch ended, a step after
    another replica can read it so (callers wait for it)."""
    return value(scrape(gateway.gateway.metrics_url), "tandem_batches_ended_total", status=status)


def test_another_gateway_reads_cancels_and_takes_on_a_batch(tiny_models, monkeypatch) -> None:
    """Over one real Redis: gateway `other` reads, lists and cancels what `runner` runs (the run sees the cancel at
    its next beat); a batch still running when its gateway shuts down is let go, and `other` goes on with it."""
    monkeypatch.setattr(batch_run, "HEARTBEAT_S", 0.2)
    monkeypatch.setattr(batches, "SWEEP_S", 0.3)
    with EmbeddedRedis() as redis:
        runner, other = _two_gateways(tiny_models, redis)
        try:
            ran, read = openai_sdk(runner), openai_sdk(other)
            input_id = _upload(read, [_chat(f"r{n}", f"x = {n}") for n in range(3)])  # uploaded to the other
            batch = ran.batches.create(input_file_id=input_id, endpoint="/v1/chat/completions",
                                       completion_window="24h")
            done = _ended(read, batch.id)
            assert done.status == "completed" and sorted(_lines(read, done.output_file_id)) == ["r0", "r1", "r2"]
            assert [b.id for b in read.batches.list()] == [batch.id]

            long = _long_batch(ran, "l")
            time.sleep(0.5)
            assert read.batches.cancel(long.id).status == "cancelling"
            assert _ended(read, long.id, timeout_s=10).status == "cancelled"  # its run saw it at a beat
            assert runner.wait_for(lambda: _ended_count(runner, "cancelled") == 1)

            orphan = _long_batch(ran, "o")
            _answering(read, orphan.id)
            runner.stop()  # shut down mid-batch: let go, and taken on by the other
            kept = read.batches.retrieve(orphan.id)
            assert kept.status == "in_progress" and 2 <= kept.request_counts.completed < 16
            finished = _ended(read, orphan.id)
            assert finished.status == "completed" and _answered_once(read, finished, "o")
            assert other.wait_for(lambda: other.gateway.batches.running == 0)  # its run ends just after storing it
            assert value(scrape(other.gateway.metrics_url), "tandem_batches_ended_total", status="completed") == 1
        finally:
            _stop(runner, other)


def test_a_batch_taken_on_without_its_input_file_keeps_what_it_answered(tiny_models, monkeypatch) -> None:
    """Deleting a batch's input file once it is submitted is a common clean-up; a replica that took the batch on
    then failed it with no output file: the answers kept so far were thrown away."""
    _short_leases(monkeypatch)
    with EmbeddedRedis() as redis:
        runner, other = _two_gateways(tiny_models, redis)
        try:
            ran, read = openai_sdk(runner), openai_sdk(other)
            # 32: the stopping runner's drain ends what it runs (up to 8), and on a loaded host 16 could all end so.
            batch = _long_batch(ran, "g", count=32)
            _answering(read, batch.id)
            read.files.delete(batch.input_file_id)
            runner.stop()
            ended = _ended(read, batch.id)
            assert ended.status == "failed" and ended.errors.data[0].code == "input_file_gone"
            answered = _lines(read, ended.output_file_id)
            assert len(answered) == ended.request_counts.completed >= 2
            assert all(line["response"]["status_code"] == 200 for line in answered.values())
        finally:
            _stop(runner, other)


def test_a_batch_whose_replica_died_is_taken_on_and_the_dead_one_writes_nothing_over_it(tiny_models,
                                                                                         monkeypatch) -> None:
    """A replica whose event loop stops (as one that died) renews no lease: once it has run out, the other gateway
    claims the batch and answers what was not kept; when the stalled replica comes back, its run finds the batch
    another's and stops without writing."""
    _short_leases(monkeypatch)
    with EmbeddedRedis() as redis:
        runner, other = _two_gateways(tiny_models, redis)
        try:
            ran, read = openai_sdk(runner), openai_sdk(other)
            batch = _long_batch(ran, "d")
            _answering(read, batch.id)
            runner.event_loop.call_soon_threadsafe(runner.event_loop.stop)
            runner.thread.join(10)
            assert read.batches.retrieve(batch.id).status == "in_progress"
            finished = _ended(read, batch.id)
            assert finished.status == "completed" and _answered_once(read, finished, "d")
            runner.thread = threading.Thread(target=runner.event_loop.run_forever, daemon=True)
            runner.thread.start()  # back: its run's next beat finds the batch another's, and it stops
            deadline = time.monotonic() + 10
            while runner.gateway.batches.running and time.monotonic() < deadline:
                time.sleep(0.05)
            assert runner.gateway.batches.running == 0
            assert read.batches.retrieve(batch.id).model_dump() == finished.model_dump()  # nothing written over it
            assert _answered_once(read, read.batches.retrieve(batch.id), "d")
        finally:
            _stop(runner, other)


def test_a_gateway_that_runs_no_batches_leaves_them_to_one_that_does(tiny_models, monkeypatch) -> None:
    monkeypatch.setattr(batches, "SWEEP_S", 0.3)
    with EmbeddedRedis() as redis:
        taker, runner = _two_gateways(tiny_models, redis, batch_concurrency=0)
        try:
            took = openai_sdk(taker)
            batch = _long_batch(took, "t", count=4)
            assert batch.status == "in_progress" and taker.gateway.batches.running == 0
            finished = _ended(took, batch.id)
            assert finished.status == "completed" and _answered_once(took, finished, "t", count=4)
            assert runner.wait_for(lambda: _ended_count(runner, "completed") == 1)
        finally:
            _stop(taker, runner)


def test_a_tenants_files_are_bounded_in_bytes(tiny_models) -> None:
    target, draft, _ = tiny_models
    gateway = ServerThread(tiny_backend(target, draft), http_port=0, file_storage_bytes=1000)
    try:
        sdk = openai_sdk(gateway)
        kept = sdk.files.create(file=("a.jsonl", b"x" * 600), purpose="batch")
        with pytest.raises(openai.APIStatusError) as full:
            sdk.files.create(file=("b.jsonl", b"y" * 600), purpose="batch")
        assert full.value.status_code == 413 and full.value.body["code"] == "file_storage_full"
        sdk.files.delete(kept.id)
        assert sdk.files.create(file=("b.jsonl", b"y" * 600), purpose="batch").bytes == 600
    finally:
        gateway.stop()
