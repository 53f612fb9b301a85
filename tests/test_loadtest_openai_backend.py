"""loadtest/'s OpenAI HTTP backend (SSE) against a real tiny-model gateway's HTTP API: it measures what the gRPC
backend does, counts tokens by chunk if told, cancels at the deadline and reports HTTP errors; and every request of a
run, by either backend, carries the run's priority."""

from __future__ import annotations

import json
import math
import threading
import time

import pytest

from loadtest.__main__ import main
from loadtest.client_run import Driver
from loadtest.config import RunConfig
from loadtest.metrics import compute
from loadtest.trace import OK
from loadtest_harness import (  # the fixture by its name: server
    MAX_TOKENS,
    _config,
    _run,
    server_fixture,  # noqa: F401
)


def _openai(server, **options) -> RunConfig:
    return _config(server, **({"address": "", "backend": "openai", "url": server.gateway.http_url} | options))


def test_openai_backend_measures_what_the_grpc_backend_does(server) -> None:
    # mixed: code prompts go to /v1/completions, chat prompts to /v1/chat/completions
    grpc_trace, _ = _run(_config(server, concurrency=2, requests=6, prompts="mixed", seed=4))
    http_trace, _ = _run(_openai(server, concurrency=2, requests=6, prompts="mixed", seed=4))
    grpc_results, http_results = compute(grpc_trace), compute(http_trace)
    assert http_results["completed"] == 6 and http_results["failed"] == 0, http_results["error_kinds"]
    assert {p.kind for p in Driver(_openai(server, requests=6, prompts="mixed", seed=4)).prompts} == {"code", "chat"}
    # Token counts from return_token_ids are exact: what the gRPC path reads from the chunks' token ids.
    assert http_results["total_output_tokens"] == grpc_results["total_output_tokens"] == 6 * MAX_TOKENS
    assert http_results["total_input_tokens"] == grpc_results["total_input_tokens"]  # same prompts, same order
    for request in http_trace.requests:
        assert request.completion_tokens == request.output_tokens == MAX_TOKENS
        assert request.finish_reason == "FINISH_REASON_LENGTH" and request.prompt_tokens > 0
        assert request.rounds > 0  # tandem's stats, read from the finish chunk's "tandem" key
    assert max(n for r in http_trace.requests for n in r.chunk_tokens) > 1  # speculative rounds: several per chunk
    assert 0 < http_results["acceptance_rate"] <= 1
    for key in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < http_results[key]["p50"] <= http_results[key]["p99"]
    assert http_trace.config["server"]["target_model"] == "tiny-target"
    assert server.wait_for(server.caches_empty)


@pytest.mark.parametrize("backend", ["grpc", "openai"])
def test_every_request_carries_the_runs_priority(server, backend: str) -> None:
    seen: set[int] = set()
    done = threading.Event()

    def watch() -> None:  # the engine's view of what arrives, while the run goes on
        while not done.is_set():
            seen.update(seq.priority for seq in list(server.engine.sequences.values()))
            time.sleep(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        config = (_openai if backend == "openai" else _config)(server, concurrency=2, requests=4, priority=7,
                                                               max_tokens=24, warmup=0)
        trace, _ = _run(config)
    finally:
        done.set()
        watcher.join()
    assert [r.status for r in trace.requests] == [OK] * 4 and seen == {7}
    with pytest.raises(ValueError, match="priority"):
        RunConfig(address=server.address, requests=1, priority=-1)


def test_openai_backend_counting_chunks_and_the_cli(server, tmp_path) -> None:
    trace, _ = _run(_openai(server, concurrency=1, requests=2, openai_token_counts="chunks", speculation="off"))
    results = compute(trace)
    assert results["completed"] == 2 and results["speculation"]["drafted"] == 0
    # one token per chunk with text: a lower bound on the tokens (a chunk may hold several, or none with text)
    assert 0 < results["total_output_tokens"] <= 2 * MAX_TOKENS
    assert all(r.completion_tokens == MAX_TOKENS for r in trace.requests)
    out = tmp_path / "run"
    code = main(["--backend", "openai", "--url", server.gateway.http_url, "--concurrency", "2", "--requests", "3",
                 "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--lengths", "short", "--out", str(out)])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert results["completed"] == 3 and results["config"]["backend"] == "openai"
    assert results["total_output_tokens"] == 3 * MAX_TOKENS


def test_openai_backend_cancels_at_the_deadline_and_reports_http_errors(server) -> None:
    config = _openai(server, rate=math.inf, requests=2, max_tokens=3000, duration=0.3, grace=0.3, warmup=0)
    trace, elapsed = _run(config)
    results = compute(trace)
    assert results["cancelled"] == 2 and results["completed"] == 0 and elapsed < 0.6 + 1.0
    assert server.wait_for(server.caches_empty)  # closing the connection cancelled the requests on the server
    # A request the gateway refuses (max_k over its limit) is an HTTP 400, counted by status.
    trace, _ = _run(_openai(server, requests=2, warmup=0, max_k=10_000))
    assert compute(trace)["error_kinds"] == {"HTTP_400": 2}
    with pytest.raises(ValueError, match="url: the openai backend needs --url"):
        RunConfig(address="127.0.0.1:1", requests=1, backend="openai")
    with pytest.raises(ValueError, match=r"url: 10\.1\.2\.3 is not a loopback address"):
        RunConfig(address="", url="http://10.1.2.3:8000", requests=1, backend="openai")
