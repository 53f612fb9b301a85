"""The OpenAI-compatible HTTP API end to end: the real openai SDK against uvicorn on the gateway's loop, tiny models."""

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
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from gateway_harness import ServerThread, tiny_backend, tiny_http_server, window_past_budget
from tandem.client import TandemClient
from tandem.gateway.options import GatewayOptions
from tandem.gateway.run import start_gateway
from tandem.v1 import generation_pb2 as pb

SERVICES = Path(__file__).resolve().parent.parent / "services"
MODEL = "tiny-target"
NEW_TOKENS = 24
GREEDY = {"temperature": 0.0, "max_tokens": NEW_TOKENS}
IGNORE_EOS = {"ignore_eos": True}
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def server(tiny_models):
    yield from tiny_http_server(tiny_models, max_prompt_tokens=512)


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


def test_chat_greedy_equals_the_grpc_stream(server) -> None:
    text, _, complete = _grpc(server, chat=[(m["role"], m["content"]) for m in CHAT], ignore_eos=True, **GREEDY)
    response = _sdk(server).chat.completions.create(model=MODEL, messages=CHAT, extra_body=IGNORE_EOS, **GREEDY)
    choice = response.choices[0]
    assert response.object == "chat.completion" and response.model == MODEL and response.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content == text and text
    assert choice.finish_reason == "length" and choice.index == 0
    usage = response.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (complete.usage.prompt_tokens, NEW_TOKENS)
    assert usage.total_tokens == usage.prompt_tokens + NEW_TOKENS
    stats = choice.model_extra["tandem"]["speculation"]
    assert stats["rounds"] > 0 and stats["drafted"] > 0 and choice.model_extra["tandem"]["request_id"] == response.id
    assert _idle(server)


def test_chat_stream_with_usage(server) -> None:
    want = _sdk(server).chat.completions.create(model=MODEL, messages=CHAT, extra_body=IGNORE_EOS, **GREEDY)
    chunks = list(_sdk(server).chat.completions.create(model=MODEL, messages=CHAT, stream=True, extra_body=IGNORE_EOS,
                                                       stream_options={"include_usage": True}, **GREEDY))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == want.choices[0].message.content
    *_, last_choice, usage_chunk = chunks
    assert last_choice.choices[0].finish_reason == "length" and last_choice.usage is None
    assert "speculation" in last_choice.choices[0].model_extra["tandem"]
    assert usage_chunk.choices == [] and usage_chunk.usage.model_dump() == want.usage.model_dump()


def test_completions_equal_the_grpc_stream(server, tiny_models) -> None:
    tokenizer = tiny_models[0].tokenizer
    sdk = _sdk(server)
    for prompt in ("def add(a, b):", tokenizer.encode("import os\n")):
        request = {"prompt": prompt} if isinstance(prompt, str) else {"token_ids": prompt}
        text, _, complete = _grpc(server, ignore_eos=True, **request, **GREEDY)
        whole = sdk.completions.create(model=MODEL, prompt=prompt, extra_body=IGNORE_EOS, **GREEDY)
        assert whole.object == "text_completion" and whole.choices[0].text == text
        assert whole.usage.prompt_tokens == complete.usage.prompt_tokens
        assert whole.usage.completion_tokens == NEW_TOKENS and whole.choices[0].finish_reason == "length"
        streamed = list(sdk.completions.create(model=MODEL, prompt=prompt, stream=True, extra_body=IGNORE_EOS,
                                               **GREEDY))
        assert "".join(c.choices[0].text for c in streamed) == text
        assert streamed[-1].choices[0].finish_reason == "length"
    assert _idle(server)


def test_a_batch_of_prompts_is_choices_prompt_by_prompt(server, tiny_models) -> None:
    """prompt as a list (strings or token ids): prompt i's choice j is choice i * n + j, each the text its prompt
    alone gives; usage counts every prompt once; streamed too. Closing a stream early cancels every prompt's work."""
    tokenizer = tiny_models[0].tokenizer
    prompts = ["def add(a, b):", "import os\n", "class A:"]
    alone = [_grpc(server, prompt=p, ignore_eos=True, **GREEDY) for p in prompts]
    sdk = _sdk(server)
    whole = sdk.completions.create(model=MODEL, prompt=prompts, n=2, extra_body=IGNORE_EOS, **GREEDY)
    assert [c.index for c in whole.choices] == list(range(6))
    assert [c.text for c in whole.choices] == [text for text, _, _ in alone for _ in range(2)]
    assert whole.usage.prompt_tokens == sum(complete.usage.prompt_tokens for _, _, complete in alone)
    assert whole.usage.completion_tokens == 6 * NEW_TOKENS
    ids = [tokenizer.encode(p) for p in prompts]
    streamed = list(sdk.completions.create(model=MODEL, prompt=ids, stream=True, extra_body=IGNORE_EOS, **GREEDY))
    texts = ["".join(c.choices[0].text for c in streamed if c.choices and c.choices[0].index == i) for i in range(3)]
    assert texts == [text for text, _, _ in alone]
    with httpx.stream("POST", f"{server.gateway.http_url}/v1/completions", timeout=60,
                      json={"prompt": prompts, "max_tokens": 200, "ignore_eos": True, "stream": True}) as response:
        next(response.iter_lines())
    assert _idle(server)


def test_return_token_ids(server) -> None:
    """vLLM's return_token_ids: the ids of each streamed chunk and of a whole choice are the gRPC stream's."""
    _, ids, _ = _grpc(server, chat=[(m["role"], m["content"]) for m in CHAT], ignore_eos=True, **GREEDY)
    extra = IGNORE_EOS | {"return_token_ids": True}
    whole = _sdk(server).chat.completions.create(model=MODEL, messages=CHAT, extra_body=extra, **GREEDY)
    assert whole.choices[0].model_extra["token_ids"] == ids
    chunks = list(_sdk(server).chat.completions.create(model=MODEL, messages=CHAT, stream=True, extra_body=extra,
                                                       **GREEDY))
    streamed = [t for c in chunks for t in (c.choices[0].model_extra.get("token_ids") or [])]
    assert streamed == ids
    plain = _sdk(server).chat.completions.create(model=MODEL, messages=CHAT, extra_body=IGNORE_EOS, **GREEDY)
    assert "token_ids" not in plain.choices[0].model_extra


def test_n_choices(server) -> None:
    sdk = _sdk(server)
    response = sdk.chat.completions.create(model=MODEL, messages=CHAT, n=3, temperature=1.0, seed=7, max_tokens=16,
                                           extra_body=IGNORE_EOS)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert len({c.message.content for c in response.choices}) > 1, "each choice samples with its own seed"
    assert response.usage.completion_tokens == 3 * 16
    request_ids = [c.model_extra["tandem"]["request_id"] for c in response.choices]
    assert request_ids == [response.id] * 3  # the id the gRPC Abort takes: it stops every choice
    chunks = list(sdk.completions.create(model=MODEL, prompt="x = ", n=2, temperature=1.0, seed=7, max_tokens=16,
                                         stream=True, stream_options={"include_usage": True}, extra_body=IGNORE_EOS))
    ends = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason}
    assert ends == {0: "length", 1: "length"} and chunks[-1].usage.completion_tokens == 2 * 16
    assert _idle(server)


def test_completion_logprobs_name_a_part_of_a_character_by_its_bytes(server) -> None:
    """Each byte of "é" decodes alone to U+FFFD: both were named "\ufffd", so `tokens` did not join to the text and
    `top_logprobs` (keyed by name) merged distinct tokens. OpenAI names them `bytes:\\xNN`."""
    prompt = "café naïve"
    response = httpx.post(f"{server.gateway.http_url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": prompt, "echo": True, "logprobs": 5, "max_tokens": 1, "temperature": 0})
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    names = logprobs["tokens"][:-1]  # the echoed prompt's tokens
    assert "\ufffd" not in "".join(names) and any(name.startswith("bytes:\\x") for name in names), names
    joined = b"".join(bytes.fromhex(name[len("bytes:"):].replace("\\x", "")) if name.startswith("bytes:")
                      else name.encode() for name in names)
    assert joined.decode() == prompt
    for name, top in zip(logprobs["tokens"][1:], logprobs["top_logprobs"][1:], strict=True):
        assert len(top) in (5, 6) and name in top  # five distinct names for five distinct tokens, and its own


def test_chat_logprobs(server, tiny_models) -> None:
    tokenizer = tiny_models[0].tokenizer
    _, ids, _ = _grpc(server, chat=[(m["role"], m["content"]) for m in CHAT], ignore_eos=True, **GREEDY)
    response = _sdk(server).chat.completions.create(model=MODEL, messages=CHAT, logprobs=True, top_logprobs=3,
                                                    extra_body=IGNORE_EOS, **GREEDY)
    content = response.choices[0].logprobs.content
    assert [entry.token for entry in content] == [tokenizer.decode([t]) for t in ids]
    special = set(tokenizer.all_special_ids)
    shown = b"".join(bytes(entry.bytes) for entry, t in zip(content, ids, strict=True) if t not in special)
    assert shown.decode("utf-8", errors="replace") == response.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the top token
    streamed = list(_sdk(server).chat.completions.create(model=MODEL, messages=CHAT, logprobs=True, stream=True,
                                                         extra_body=IGNORE_EOS, **GREEDY))
    tokens = [e.token for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert tokens == [entry.token for entry in content]


def test_completion_logprobs(server) -> None:
    response = _sdk(server).completions.create(model=MODEL, prompt="def add(a, b):", logprobs=2,
                                               extra_body=IGNORE_EOS, **GREEDY)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == NEW_TOKENS
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    assert all(len(top) == 2 for top in logprobs.top_logprobs)  # greedy: the token is the first of its two
    assert all(top[token] == value for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs,
                                                                logprobs.top_logprobs, strict=True))
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    assert logprobs.text_offset[-1] <= len(response.choices[0].text)


def test_stop_strings(server) -> None:
    sdk = _sdk(server)
    sample = sdk.completions.create(model=MODEL, prompt="def add(a, b):", temperature=0, max_tokens=40,
                                    extra_body=IGNORE_EOS).choices[0].text
    stop = sample[12:14]
    want, _, _ = _grpc(server, prompt="def add(a, b):", temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    for stream in (False, True):
        response = sdk.completions.create(model=MODEL, prompt="def add(a, b):", temperature=0, max_tokens=40,
                                          stop=stop, stream=stream, extra_body=IGNORE_EOS)
        chunks = list(response) if stream else [response]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want and stop not in want
        assert chunks[-1].choices[0].finish_reason == "stop"


def _error(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    return caught.value


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


def test_newer_and_extra_fields(server) -> None:
    """max_completion_tokens, content parts, the developer role, and tandem's extras (speculation, session)."""
    messages = [{"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "def add"}, {"type": "text", "text": "(a, b):"}]}]
    text, _, _ = _grpc(server, chat=[("system", "be brief"), ("user", "def add\n(a, b):")], ignore_eos=True,
                       temperature=0, max_tokens=5)
    response = _sdk(server).chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=5, max_tokens=50, temperature=0, user="someone",
        extra_body={"ignore_eos": True, "speculation": "off", "session_id": "openai-session", "request_id": "mine-1"})
    assert response.id == "mine-1" and response.choices[0].message.content == text
    assert response.usage.completion_tokens == 5
    assert response.choices[0].model_extra["tandem"]["speculation"]["drafted"] == 0


def test_penalties_and_bias_mean_the_same_on_both_apis(server) -> None:
    """OpenAI's presence and frequency penalties and logit_bias, with vLLM's repetition_penalty, give the gRPC
    request's tokens; a bias of -100 on the token greedy decoding picks first takes it away."""
    sdk = _sdk(server)
    _, plain_ids, _ = _grpc(server, chat=CHAT, ignore_eos=True, **GREEDY)
    shaped = {"presence_penalty": 0.5, "frequency_penalty": 1.0, "repetition_penalty": 1.2}
    bias = {plain_ids[0]: -100.0, plain_ids[2]: 3.0}
    _, ids, _ = _grpc(server, chat=CHAT, ignore_eos=True, logit_bias=bias, **shaped, **GREEDY)
    assert ids[0] != plain_ids[0] and ids != plain_ids
    response = sdk.chat.completions.create(
        model=MODEL, messages=CHAT, presence_penalty=0.5, frequency_penalty=1.0,
        logit_bias={str(token): value for token, value in bias.items()},
        extra_body={"ignore_eos": True, "repetition_penalty": 1.2, "return_token_ids": True}, **GREEDY)
    assert response.choices[0].model_extra["token_ids"] == ids
    assert _idle(server)


def test_usage_of_n_choices_counts_what_was_cached_before_the_request(server) -> None:
    """n choices of one prompt compute it once and copy it (prefix caching): their usage says the prompt was not
    cached before the request, whichever choice finished first; a repeat of it then finds it cached."""
    sdk = _sdk(server)
    question = "Review this code for bugs and style, then rewrite it: " + " ".join(f"x{n} = {n}" for n in range(30))
    for _ in range(3):
        fresh = f"{uuid.uuid4().hex} {question}"
        first = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": fresh}], n=3,
                                            max_tokens=4, temperature=0.9, seed=1)
        assert first.usage.prompt_tokens_details.cached_tokens < 16, first.usage
        assert _idle(server)
        again = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": fresh}], n=3,
                                            max_tokens=4, temperature=0.9, seed=1)
        assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_usage_counts_the_prompt_tokens_a_cached_prefix_served(server) -> None:
    """A request whose system prompt a finished one had: its usage says how many prompt tokens were not computed
    (prefix caching), through the chat API, the Responses API and gRPC."""
    system = "You review Python code. " * 12  # long enough to share (core.runner.MIN_SHARED_PREFIX)
    sdk = _sdk(server)

    def chat(question: str):
        return sdk.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": system},
                                                                  {"role": "user", "content": question}], **GREEDY)

    chat("def add(a, b):")
    assert _idle(server)
    second = chat("def sub(a, b):")
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < second.usage.prompt_tokens
    response = sdk.responses.create(model=MODEL, instructions=system, input="def mul(a, b):", max_output_tokens=4,
                                    temperature=0)
    assert 16 <= response.usage.input_tokens_details.cached_tokens < response.usage.input_tokens
    ids = list(range(100, 140))
    _, _, first = _grpc(server, token_ids=ids + [1], **GREEDY)
    _, _, again = _grpc(server, token_ids=ids + [2], **GREEDY)
    assert first.usage.cached_prompt_tokens < len(ids) <= again.usage.cached_prompt_tokens
    assert _idle(server)


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
        with caplog.at_level(logging.WARNING, logger="tandem.gateway.server"):
            assert asyncio.run(start(port, fallback=True)) not in (None, port)
        assert f"HTTP port {port} is taken: the HTTP API serves on a free port instead" in caplog.text
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port} for HTTP"):
            asyncio.run(start(port, fallback=False))
        async def start_metrics() -> None:
            gateway = await start_gateway(load, GatewayOptions(port=0, metrics_port=port, metrics_port_fallback=True))
            await gateway.drain(0)

        with caplog.at_level(logging.WARNING, logger="tandem.telemetry.metrics"):  # and the default metrics port
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
