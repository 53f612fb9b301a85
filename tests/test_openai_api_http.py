"""The OpenAI-compatible HTTP API's routes and refusals on a gateway in this process, tiny models: models and health
(HEAD too), request ids and a 405's allowed methods, TCP_NODELAY, idle connections kept open, bad bodies refused with
a 400 that names the field (bad values, lone surrogates, nesting past the parser, nulls meaning defaults), other
request errors, and a client that leaves mid-response freeing its caches."""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest

from gateway_harness import ServerThread, tiny_backend, tiny_http_server
from openai_api_harness import CHAT, MODEL, _error, _idle, _sdk


@pytest.fixture(scope="module")
def server(tiny_models):
    yield from tiny_http_server(tiny_models, max_prompt_tokens=512)


def test_models_and_health(server) -> None:
    models = _sdk(server).models.list()
    assert [m.id for m in models.data] == [MODEL] and models.data[0].owned_by == "tandem"
    assert models.data[0].model_extra["max_model_len"] == server.gateway.generations.model_limits.context_window
    assert _sdk(server).models.retrieve(MODEL) == models.data[0]
    with pytest.raises(openai.NotFoundError) as missing:
        _sdk(server).models.retrieve("org/other-model")  # a model id may hold a slash
    assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"
    health = httpx.get(f"{server.gateway.http_url}/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    probed = httpx.head(f"{server.gateway.http_url}/health")  # uptime probes, curl -I
    assert probed.status_code == 200 and probed.content == b""
    for path, status in (("/v1/models", 200), (f"/v1/models/{MODEL}", 200), ("/v1/models/other", 404)):
        headed = httpx.head(f"{server.gateway.http_url}{path}")  # as GET, without the body
        assert headed.status_code == status and headed.content == b"", path
    listed = httpx.get(f"{server.gateway.http_url}/v1/models/")  # a trailing slash: the list, not model ""
    assert listed.status_code == 200 and [m["id"] for m in listed.json()["data"]] == [MODEL]


def test_every_answer_carries_a_request_id_and_a_405_its_allowed_methods(server) -> None:
    """OpenAI's x-request-id (the SDKs' `_request_id`): the client's own where it sent a printable one."""
    url = server.gateway.http_url
    made = _sdk(server).models.with_raw_response.list()
    assert made.headers["x-request-id"].startswith("req_") and made.request_id == made.headers["x-request-id"]
    for response in (httpx.get(f"{url}/health"), httpx.get(f"{url}/v1/nowhere"),
                     httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1})):
        assert response.headers["x-request-id"].startswith("req_")
    mine = httpx.get(f"{url}/v1/models", headers={"x-request-id": "trace-42"})
    assert mine.headers["x-request-id"] == "trace-42"
    odd = httpx.get(f"{url}/v1/models", headers={"x-request-id": "x" * 500})
    assert odd.headers["x-request-id"].startswith("req_")
    wrong = httpx.get(f"{url}/v1/chat/completions")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST" and "Invalid URL" in wrong.text
    slashed = httpx.post(f"{url}/tokenize/", json={"prompt": "hi"}, headers={"host": "evil.example.com"})
    assert slashed.status_code == 404 and "location" not in slashed.headers  # no redirect built from a Host header


def test_http_connections_send_without_waiting_for_acks(server) -> None:
    """Nagle's algorithm was on (the listening socket named no protocol, so asyncio left TCP_NODELAY off): uvicorn
    writes a response's head and body apart, and a keep-alive request waited ~40 ms for the client's delayed ACK."""
    with httpx.Client(base_url=server.gateway.http_url) as client:
        assert client.get("/health").status_code == 200  # the connection stays open
        connections = server.gateway.http.server.server_state.connections
        sockets = [c.transport.get_extra_info("socket") for c in connections]
        assert sockets and all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in sockets)


def _health_on(sock: socket.socket) -> bytes:
    """GET /health on an open connection, read whole: the response's status line, or b"" where the server had closed
    the connection."""
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n")
        received = b""
        while b"\r\n\r\n" not in received or len(received.split(b"\r\n\r\n", 1)[1]) < len(b'{"status":"ok"}'):
            if not (chunk := sock.recv(65536)):
                return b""
            received += chunk
        return received.split(b"\r\n", 1)[0]
    except OSError:  # (reset: it was closed)
        return b""


def test_an_idle_connection_outlasts_a_proxys_idle_timeout_and_the_option_sets_it(server, tiny_models) -> None:
    """A proxy or load balancer reuses a pooled connection idle up to its own timeout (nginx and AWS ALB 60 s); one
    the gateway closed first fails its POST as a 502. uvicorn closed idle ones after 5 s: now it is
    --http-keep-alive, 75 s by default (docs/bench/http-keep-alive-v1.json: reused after 65 s idle)."""
    with socket.create_connection(("127.0.0.1", server.gateway.http_port), timeout=10) as sock:
        assert _health_on(sock) == b"HTTP/1.1 200 OK"
        time.sleep(6.0)  # past uvicorn's default
        assert _health_on(sock) == b"HTTP/1.1 200 OK"
    target, draft, _ = tiny_models
    short = ServerThread(tiny_backend(target, draft), http_port=0, http_keep_alive_s=0.5)
    try:
        with socket.create_connection(("127.0.0.1", short.gateway.http_port), timeout=10) as sock:
            assert _health_on(sock) == b"HTTP/1.1 200 OK"
            time.sleep(1.5)
            assert _health_on(sock) == b""
    finally:
        short.stop()


@pytest.mark.parametrize(("body", "param"), [
    ({"temperature": -1.0}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),  # OpenAI requires it
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"n": 0}, "n"),
    ({"seed": -1}, "seed"),
    ({"top_k": -1}, "top_k"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"max_completion_tokens": 2**40}, "max_tokens"),
    ({"stop": [""]}, "stop[0]"),
    ({"tool_choice": "required"}, "tool_choice"),  # with no tools to call
    ({"max_k": 99}, "max_k"),
    ({"speculation": "sometimes"}, "speculation"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"modalities": ["text", "audio"]}, "modalities"),  # OpenAI features not served: refused, not answered in text
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"web_search_options": {}}, "web_search_options"),  # an answer without the search asked for: refused
    ({"use_beam_search": True}, "use_beam_search"),  # vLLM's extras not followed: refused, not silently ignored
    ({"min_tokens": 5000}, "min_tokens"),  # more than max_tokens
    ({"bad_words": ["x"]}, "bad_words"),
    ({"skip_special_tokens": False}, "skip_special_tokens"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"function_call": {"name": "add"}}, "function_call"),
])
def test_bad_fields_are_400_naming_the_param(server, body, param) -> None:
    request = {"model": MODEL, "messages": CHAT, "max_tokens": 4} | body
    response = httpx.post(f"{server.gateway.http_url}/v1/chat/completions", json=request)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"].startswith(f"{param}: ")


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud800"}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": CHAT, "stop": ["ok", "\udfff"]}, "stop[1]"),
    ("/v1/chat/completions", {"messages": CHAT, "request_id": "a\ud83d"}, "request_id"),
    ("/v1/completions", {"prompt": "hi \ud800"}, "prompt"),
    ("/v1/responses", {"input": "hi", "instructions": "\udc00 be brief"}, "instructions"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
])
def test_a_lone_surrogate_is_a_400_naming_its_field(server, path, body, param) -> None:
    """JSON may escape half a UTF-16 pair ("\\ud800"): valid JSON, but no text that UTF-8, protobuf or a tokenizer
    takes. It is refused by name, never a 500; a whole pair is a character like any other."""
    sent = json.dumps({"model": MODEL, "max_tokens": 2} | body)  # json.dumps writes the lone half as its escape
    response = httpx.post(f"{server.gateway.http_url}{path}", content=sent,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param and "surrogate" in response.json()["error"]["message"]
    paired = httpx.post(f"{server.gateway.http_url}/v1/completions",
                        json={"model": MODEL, "prompt": "hi \U0001f600", "max_tokens": 2})
    assert paired.status_code == 200, paired.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize"])
def test_a_body_nested_past_the_parsers_depth_is_a_400(server, path: str) -> None:
    """json.loads raised RecursionError: a 500 and a logged traceback per request."""
    deep = b"[" * 2000 + b"]" * 2000
    sent = b'{"model": "%s", "messages": [], "x": %s}' % (MODEL.encode(), deep)
    response = httpx.post(f"{server.gateway.http_url}{path}", content=sent,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"] == "the body nests arrays or objects too deeply"


def test_null_flags_mean_their_defaults(server) -> None:
    """OpenAI's schema marks these flags nullable, and clients that send every field send null."""
    url = server.gateway.http_url
    flags = {"stream": None, "logprobs": None, "ignore_eos": None, "return_token_ids": None, "modalities": ["text"]}
    chat = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 2} | flags)
    assert chat.status_code == 200, chat.text
    assert chat.json()["object"] == "chat.completion" and chat.json()["choices"][0]["logprobs"] is None
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0}
    completion = httpx.post(f"{url}/v1/completions", json=body | {"echo": None, "stream": None,
                                                                  "stream_options": {"include_usage": None}})
    assert completion.status_code == 200, completion.text
    unset = httpx.post(f"{url}/v1/completions", json=body).json()
    assert completion.json()["choices"][0]["text"] == unset["choices"][0]["text"]  # no echo


def test_request_errors(server) -> None:
    sdk, url = _sdk(server), server.gateway.http_url
    many = sdk.completions.create(model=MODEL, prompt=[[5, 6]] * 40, max_tokens=2, temperature=0)  # lm-eval's 32+
    assert [choice.index for choice in many.choices] == list(range(40)) and len({c.text for c in many.choices}) == 1
    places = server.gateway.loop.max_requests
    error = _error(lambda: sdk.completions.create(model=MODEL, prompt=["a"] * (places // 2 + 1), max_tokens=4, n=2))
    assert error.status_code == 400 and error.body["param"] == "prompt"
    assert f"more sequences than this server's queue holds for a caller ({places}" in error.body["message"]
    error = _error(lambda: sdk.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=4))
    assert error.status_code == 404 and error.body["code"] == "model_not_found" and error.body["param"] == "model"
    for response in (httpx.post(f"{url}/v1/embeddings", json={}), httpx.get(f"{url}/v1/chat/completions")):
        assert response.status_code in (404, 405) and "Invalid URL" in response.json()["error"]["message"]
    bad_json = httpx.post(f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and bad_json.json()["error"]["type"] == "invalid_request_error"
    # The model may be omitted: it is the served one.
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3


def test_stream_disconnect_frees_caches(server) -> None:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.gateway.http_url}/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert server.gateway.loop.active == 1
    assert _idle(server)


def test_whole_response_disconnect_frees_caches(server) -> None:
    """A client that leaves while a non-streamed response is being generated: the handler notices and cancels."""
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 4000, "temperature": 0, "ignore_eos": True})
    port = server.gateway.http_port
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        assert server.wait_for(lambda: server.gateway.loop.active == 1)
    assert _idle(server)
