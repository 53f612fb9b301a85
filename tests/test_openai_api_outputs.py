"""The OpenAI-compatible HTTP API's outputs end to end, the real openai SDK against uvicorn on the gateway's loop, tiny
models: chat and completions (whole, streamed, batched, n choices) equal to the gRPC stream's, token ids, logprobs,
stop strings, penalties and bias, newer and tandem's extra fields, and usage's cached prompt tokens."""

from __future__ import annotations

import uuid

import httpx
import pytest

from gateway_harness import tiny_http_server
from openai_api_harness import CHAT, GREEDY, IGNORE_EOS, MODEL, NEW_TOKENS, _grpc, _idle, _sdk


@pytest.fixture(scope="module")
def server(tiny_models):
    yield from tiny_http_server(tiny_models, max_prompt_tokens=512)


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
