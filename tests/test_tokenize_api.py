"""vLLM's /tokenize, /detokenize and /tokenizer_info on a real gateway over the tiny pair: the ids a request is given
(as gRPC's Tokenize and the usage of a real request count them), those vLLM's flags ask for instead, their texts, what
a remote tokenizer (lm-eval's) reads, and refusals naming the field."""

from __future__ import annotations

import httpx
import openai
import pytest

from gateway_harness import tiny_http_server
from tandem.client import TandemClient

MODEL = "tiny-target"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def server(tiny_models):
    yield from tiny_http_server(tiny_models, max_prompt_tokens=2048)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.gateway.http_url}/{path}", json=body, timeout=60)


def test_tokenize_gives_the_ids_a_request_is_given(server, tiny_models) -> None:
    sdk = openai.OpenAI(base_url=f"{server.gateway.http_url}/v1", api_key="x", max_retries=0)
    with TandemClient(server.address, timeout=60) as client:
        prompt = _post(server, "tokenize", {"model": MODEL, "prompt": "def add(a, b):", "return_token_strs": True})
        assert prompt.status_code == 200, prompt.text
        body = prompt.json()
        assert body["tokens"] == client.tokenize("def add(a, b):") and body["count"] == len(body["tokens"])
        assert body["max_model_len"] == server.gateway.generations.model_limits.context_window
        assert body["token_strs"] == tiny_models[0].tokenizer.convert_ids_to_tokens(body["tokens"])
        chat = _post(server, "tokenize", {"messages": CHAT, "tools": [WEATHER]}).json()
        assert chat["tokens"] == client.tokenize(chat=CHAT, tools=[WEATHER]) and chat["token_strs"] is None
    asked = sdk.chat.completions.create(model=MODEL, messages=CHAT, tools=[WEATHER], max_tokens=1)
    assert asked.usage.prompt_tokens == chat["count"]
    text = _post(server, "detokenize", {"model": MODEL, "tokens": body["tokens"]})
    assert text.status_code == 200 and text.json() == {"prompt": "def add(a, b):"}


def test_vllms_flags_ask_for_the_ids_without_special_tokens_or_the_assistants_turn(server, tiny_models) -> None:
    """What lm-eval's remote tokenizer sends (`add_special_tokens: false`), and a chat's ids without the opened
    assistant turn (`add_generation_prompt: false`), as the tokenizer itself gives them."""
    tokenizer = tiny_models[0].tokenizer
    plain = _post(server, "tokenize", {"prompt": "def add(a, b):", "add_special_tokens": False})
    assert plain.status_code == 200, plain.text
    unset = _post(server, "tokenize", {"prompt": "def add(a, b):", "add_special_tokens": None})  # null: the default
    assert unset.json()["tokens"] == _post(server, "tokenize", {"prompt": "def add(a, b):"}).json()["tokens"]
    assert plain.json()["tokens"] == tokenizer.encode("def add(a, b):", add_special_tokens=False)
    opened = _post(server, "tokenize", {"messages": CHAT}).json()["tokens"]
    closed = _post(server, "tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()["tokens"]
    assert closed == tokenizer.apply_chat_template(CHAT, add_generation_prompt=False, tokenize=True, return_dict=False)
    assert len(closed) < len(opened) and opened[:len(closed)] == closed


def test_tokenizer_info_tells_a_remote_tokenizer_what_it_needs(server, tiny_models) -> None:
    tokenizer = tiny_models[0].tokenizer
    info = httpx.get(f"{server.gateway.http_url}/tokenizer_info", timeout=30)
    assert info.status_code == 200, info.text
    body = info.json()
    assert body["eos_token"] == tokenizer.eos_token and body["chat_template"] == tokenizer.chat_template
    assert body["model_max_length"] == server.gateway.generations.model_limits.context_window
    assert set(body) == {"tokenizer_class", "eos_token", "bos_token", "pad_token", "unk_token", "chat_template",
                         "model_max_length", "vocab_size"}  # these alone: not the tokenizer's whole config
    eos = _post(server, "tokenize", {"prompt": body["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert eos[0] in server.gateway.generations.backend.engine.eos_token_ids  # as lm-eval finds its eos id


@pytest.mark.parametrize(("path", "body", "param"), [
    ("tokenize", {}, "prompt"),
    ("tokenize", {"prompt": "x", "messages": CHAT}, "prompt"),
    ("tokenize", {"prompt": "x", "add_special_tokens": "no"}, "add_special_tokens"),
    ("tokenize", {"prompt": "x", "model": "gpt-9"}, "model"),
    ("tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("tokenize", {"messages": [{"role": "user", "content": None}]}, "messages[0].content"),  # was accepted
    ("tokenize", {"prompt": ""}, "prompt"),
    ("detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("detokenize", {"tokens": "abc"}, "tokens"),
])
def test_refusals_name_the_field(server, path: str, body: dict, param: str) -> None:
    response = _post(server, path, body)
    assert response.status_code in (400, 404), response.text
    assert response.json()["error"]["param"] == param
    assert "chat" not in response.json()["error"]["message"]  # the engine's own name for messages
