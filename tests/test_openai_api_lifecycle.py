"""The OpenAI-compatible HTTP API on gateways of their own, tiny models: the engine's refusal mid-generation, a full
queue's 429, 503s while loading and draining, a stream past the drain's grace, a taken HTTP or metrics port, and
`tandem serve` printing its HTTP address and serving it."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest

from gateway_harness import ServerThread, tiny_backend, window_past_budget
from openai_api_harness import CHAT, IGNORE_EOS, MODEL, _error, _idle, _sdk
from tandem.gateway.options import GatewayOptions
from tandem.gateway.run import start_gateway

SERVICES = Path(__file__).resolve().parent.parent / "services"


def test_engine_refusal_mid_generation(tiny_models) -> None:
    """A sequence that outgrows the whole KV budget: refused before it runs where the server's max_model_len is that
    budget; where a worker holds less than the window the gateway was told, refused by the engine once it gets
    there, after some tokens: a whole response is a 400 with the reason; a stream, already under way, ends with an
    error event the SDK raises."""
    request = {"model": MODEL, "prompt": list(range(3, 63)), "max_tokens": 80, "extra_body": IGNORE_EOS}
    checked = ServerThread(tiny_backend(tiny_models[0], None, kv_tokens=96), http_port=0)
    try:
        assert _sdk(checked).models.list().data[0].model_extra["max_model_len"] == 96
        error = _error(lambda: _sdk(checked).completions.create(stream=True, **request))
        assert error.status_code == 400 and error.body["param"] == "max_tokens"
        assert "context window of 96" in error.body["message"]
    finally:
        checked.stop()
    small = ServerThread(window_past_budget(tiny_backend(tiny_models[0], None, kv_tokens=96)), http_port=0)
    try:
        sdk = _sdk(small)
        error = _error(lambda: sdk.completions.create(**request))
        assert error.status_code == 400 and "budget of 96" in error.body["message"]
        chunks = []
        with pytest.raises(openai.APIError) as caught:
            chunks.extend(sdk.completions.create(stream=True, **request))
        assert chunks and "budget of 96" in caught.value.body["message"]
        assert caught.value.body["type"] == "invalid_request_error"
        assert _idle(small)
    finally:
        small.stop()


def test_queue_full_is_429(tiny_models) -> None:
    target, draft, _ = tiny_models
    small = ServerThread(tiny_backend(target, draft), http_port=0, max_requests=1)
    try:
        sdk = _sdk(small)
        stream = sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4000, temperature=0, stream=True,
                                             extra_body=IGNORE_EOS)
        next(iter(stream))
        error = _error(lambda: sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4))
        assert error.status_code == 429 and error.body["code"] == "queue_full"
        assert error.response.headers["retry-after"] == "1"
        stream.close()
        assert _idle(small)
        # More choices than the queue holds could never run: a 400 naming n, which no client retries, on an idle server.
        for call, param in ((lambda: sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, n=2), "n"),
                            (lambda: sdk.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=4), "prompt")):
            error = _error(call)
            assert error.status_code == 400 and error.body["param"] == param and "--max-queue" in error.body["message"]
        assert sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2).choices
    finally:
        small.stop()


def test_503_while_loading_and_draining(tiny_models) -> None:
    target, draft, _ = tiny_models
    loaded = threading.Event()
    backend = tiny_backend(target, draft)
    running = ServerThread(lambda: loaded.wait(60) and backend(), wait_ready=False, http_port=0)
    try:
        sdk, url = _sdk(running), running.gateway.http_url
        assert httpx.get(f"{url}/health").json() == {"status": "loading"}
        error = _error(lambda: sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4))
        assert error.status_code == 503 and "loading" in error.body["message"]
        assert httpx.get(f"{url}/v1/models").status_code == 503
        loaded.set()
        running.call(running.gateway.ready())
        assert httpx.get(f"{url}/health").status_code == 200
        stream = sdk.completions.create(model=MODEL, prompt="x", max_tokens=48, temperature=0, stream=True,
                                        extra_body=IGNORE_EOS)
        first = next(iter(stream))
        running.start_drain(grace=30)
        assert running.wait_for(lambda: httpx.get(f"{url}/health").status_code == 503)
        assert httpx.get(f"{url}/health").json() == {"status": "draining"}
        error = _error(lambda: sdk.completions.create(model=MODEL, prompt="x", max_tokens=4))
        assert error.status_code == 503
        rest = list(stream)  # the request in flight finishes within the grace period
        assert rest[-1].choices[0].finish_reason == "length"
        text = first.choices[0].text + "".join(c.choices[0].text for c in rest)
        assert len(text) > 0
        assert running.wait_for(lambda: running.gateway.draining and running.gateway.http.task.done())
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health")
    finally:
        loaded.set()
        running.stop()


def test_a_stream_still_running_when_the_grace_ends_is_told_so(tiny_models) -> None:
    """Past the drain's grace, a stream in flight ends as any failed stream does, with an error event and [DONE]
    (was: cut off, as uvicorn cancelled the response, with a traceback in the log), as gRPC ends with UNAVAILABLE."""
    running = ServerThread(tiny_backend(tiny_models[0], None), http_port=0)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4000, "temperature": 0, "stream": True, "ignore_eos": True}
    try:
        with httpx.stream("POST", f"{running.gateway.http_url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            running.start_drain(grace=0.2)
            data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        assert data[-1] == "[DONE]", data[-3:]
        error = json.loads(data[-2])["error"]
        assert "shutting down" in error["message"], error
        assert running.wait_for(lambda: running.gateway.draining and running.gateway.http.task.done())
    finally:
        running.stop()


def test_a_taken_http_port(tiny_models, caplog) -> None:
    """A taken --http-port fails the start naming the address, unless it was the default (then a free port, with a
    warning: a client of :8000 would reach whatever holds it)."""
    load = tiny_backend(tiny_models[0], None)

    async def start(port: int, fallback: bool) -> int | None:
        gateway = await start_gateway(load, GatewayOptions(port=0, http_port=port, http_port_fallback=fallback))
        try:
            return gateway.http_port
        finally:
            await gateway.drain(0)

    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        with caplog.at_level(logging.WARNING, logger="tandem.gateway.http_api"):
            assert asyncio.run(start(port, fallback=True)) not in (None, port)
        assert f"HTTP port {port} is taken: the HTTP API serves on a free port instead" in caplog.text
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port} for HTTP"):
            asyncio.run(start(port, fallback=False))
        async def start_metrics() -> None:
            gateway = await start_gateway(load, GatewayOptions(port=0, metrics_port=port, metrics_port_fallback=True))
            await gateway.drain(0)

        with caplog.at_level(logging.WARNING, logger="tandem.telemetry.endpoint"):  # and the default metrics port
            asyncio.run(start_metrics())
        assert f"metrics port {port} is taken: /metrics serves on" in caplog.text
        # So is a taken --metrics-port given on purpose.
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port} for /metrics: Address already in use"):
            asyncio.run(start_gateway(load, GatewayOptions(port=0, metrics_port=port)))


def test_tandem_serve_prints_and_serves_http(tiny_dirs) -> None:
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(SERVICES), os.environ.get("PYTHONPATH")])),
                        "REDIS_URL": ""}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem", "serve", "--in-process", "--target", str(tiny_dirs.target), "--draft",
         str(tiny_dirs.draft), "--port", "0", "--http-port", "0", "--no-metrics", "--dtype", "float32",
         "--threads", "1", "--kv-tokens", "4096", "--grace", "5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = None
        for line in proc.stdout:
            if "OpenAI-compatible HTTP API on " in line:
                url = line.split(" on ")[1].split()[0].removesuffix("/v1")
                break
        assert url, proc.stderr.read() if proc.poll() is not None else "no HTTP line"
        for _ in range(480):  # loading (and calibrating) happens after the ports are bound
            assert proc.poll() is None, proc.stderr.read()
            if httpx.get(f"{url}/health").status_code == 200:
                break
            threading.Event().wait(0.25)
        sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
        response = sdk.completions.create(model=str(tiny_dirs.target), prompt="hi", max_tokens=5,
                                          extra_body=IGNORE_EOS)
        assert response.usage.completion_tokens == 5
        assert response.model == "target"  # the served directory's name: no server path in what clients see
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
