"""The completions API's `echo` (the prompt, then the completion) with and without logprobs, as evaluation harnesses
score answers (lm-evaluation-harness sends token-id prompts, echo, logprobs 1, max_tokens 1, and reads the prompt's
token_logprobs after the context); and gRPC's prompt_logprobs beneath it. Tiny models, a real gateway."""

from __future__ import annotations

import json

import grpc
import httpx
import openai
import pytest
import torch

from gateway_harness import tiny_http_server
from tandem.client import TandemClient
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc

MODEL = "tiny-target"
PROMPTS = [[72, 101, 108, 108, 111, 44, 32, 119], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49], [97, 98]]


@pytest.fixture(scope="module")
def server(tiny_models):
    yield from tiny_http_server(tiny_models, max_prompt_tokens=512)


def _post(server, body: dict) -> dict:
    response = httpx.post(f"{server.gateway.http_url}/v1/completions", json={"model": MODEL} | body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _plain_forward(target, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(target.model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def test_echo_with_logprobs_scores_every_prompt_token_as_a_harness_reads_them(server, tiny_models) -> None:
    target = tiny_models[0]
    body = _post(server, {"prompt": PROMPTS, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0})
    for prompt, choice in zip(PROMPTS, sorted(body["choices"], key=lambda c: c["index"]), strict=True):
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(prompt) + 1
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        reference = _plain_forward(target, prompt)
        for i in range(1, len(prompt)):  # position i - 1 scores prompt token i
            assert logprobs["token_logprobs"][i] == pytest.approx(float(reference[i - 1, prompt[i]]), abs=1e-4)
            top = logprobs["top_logprobs"][i]  # the best alternative, and the prompt's token itself (OpenAI's)
            assert len(top) <= 2 and max(top.values()) == pytest.approx(float(reference[i - 1].max()), abs=1e-4)
            assert top[logprobs["tokens"][i]] == logprobs["token_logprobs"][i]
        # The echoed text is the prompt's, and the offsets run on from it into the completion.
        prompt_text = target.tokenizer.decode(prompt)
        assert choice["text"].startswith(prompt_text)
        assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
        assert logprobs["text_offset"][len(prompt)] == len(prompt_text)


def test_echo_without_logprobs_is_the_prompt_then_the_same_completion(server, tiny_models) -> None:
    prompt = "def add(a, b):"
    plain = _post(server, {"prompt": prompt, "max_tokens": 12, "temperature": 0})["choices"][0]["text"]
    echoed = _post(server, {"prompt": prompt, "echo": True, "max_tokens": 12, "temperature": 0})["choices"][0]
    assert echoed["text"] == prompt + plain and echoed["logprobs"] is None


def test_an_echoed_prompt_keeps_its_special_tokens(server) -> None:
    """A prompt with a chat template's markers typed in comes back as sent, and the completion's logprobs begin at
    its length: a client cuts the prompt off the text by that, as it would without the markers. The completion's
    own special tokens stay hidden, as without echo."""
    prompt = "<|im_start|>user\ndef add(a, b):<|im_end|>\n<|im_start|>assistant\n"
    asked = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    plain = _post(server, asked)["choices"][0]["text"]
    for stream in (False, True):
        body = asked | {"echo": True, "logprobs": 1}
        if stream:
            response = httpx.post(f"{server.gateway.http_url}/v1/completions", timeout=60,
                                  json={"model": MODEL, "stream": True} | body)
            chunks = [json.loads(line[6:]) for line in response.text.splitlines()
                      if line.startswith("data: {")]
            text = "".join(chunk["choices"][0]["text"] for chunk in chunks if chunk["choices"])
            offsets = [o for chunk in chunks if chunk["choices"] and chunk["choices"][0]["logprobs"]
                       for o in chunk["choices"][0]["logprobs"]["text_offset"]]
        else:
            choice = _post(server, body)["choices"][0]
            text, offsets = choice["text"], choice["logprobs"]["text_offset"]
        assert text == prompt + plain, stream
        prompt_tokens = len(offsets) - 8
        assert offsets[prompt_tokens] == len(prompt) and offsets[1] == len("<|im_start|>"), stream


def test_a_streamed_echo_equals_the_whole_response(server) -> None:
    sdk = openai.OpenAI(base_url=f"{server.gateway.http_url}/v1", api_key="x", max_retries=0, timeout=60)
    request = {"model": MODEL, "prompt": PROMPTS[0], "echo": True, "logprobs": 2, "max_tokens": 6, "temperature": 0}
    whole = sdk.completions.create(**request).choices[0]
    chunks = [c.choices[0] for c in sdk.completions.create(stream=True, **request) if c.choices]
    assert "".join(c.text for c in chunks) == whole.text
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for c in chunks if c.logprobs for v in getattr(c.logprobs, key)] == getattr(whole.logprobs, key)


def test_max_tokens_0_with_echo_scores_the_prompt_and_generates_nothing(server, tiny_models) -> None:
    """OpenAI's legacy scoring (older harnesses send it): the prompt back with its logprobs, what max_tokens 1 gives
    for the prompt's tokens, no completion token; whole or streamed alike. Without echo, 0 is refused naming it."""
    sdk = openai.OpenAI(base_url=f"{server.gateway.http_url}/v1", api_key="x", max_retries=0, timeout=60)
    asked = {"model": MODEL, "prompt": PROMPTS[0], "echo": True, "logprobs": 2, "temperature": 0}
    scored = sdk.completions.create(max_tokens=0, **asked)
    one = sdk.completions.create(max_tokens=1, **asked)
    prompt_tokens = len(PROMPTS[0])
    choice, reference = scored.choices[0], one.choices[0]
    assert choice.text == tiny_models[0].tokenizer.decode(PROMPTS[0])
    assert choice.finish_reason == "length" and scored.usage.completion_tokens == 0
    assert scored.usage.prompt_tokens == prompt_tokens
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert getattr(choice.logprobs, key) == getattr(reference.logprobs, key)[:prompt_tokens]
    chunks = [c.choices[0] for c in sdk.completions.create(max_tokens=0, stream=True, **asked) if c.choices]
    assert "".join(c.text for c in chunks) == choice.text
    assert [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs] == choice.logprobs.token_logprobs
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=0)
    assert refused.value.body["param"] == "max_tokens"


def test_grpc_prompt_logprobs_come_in_each_choices_first_chunk(server, tiny_models) -> None:
    reference = _plain_forward(tiny_models[0], PROMPTS[1])
    with grpc.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPTS[1]), n=2, prompt_logprobs=3,
                                     sampling=pb.SamplingParams(temperature=0.0, max_tokens=5))
        chunks = [r.chunk for r in stub.Generate(request, timeout=60) if r.WhichOneof("kind") == "chunk"]
        for index in (0, 1):
            mine = [c for c in chunks if c.index == index]
            scored = mine[0].prompt_logprobs
            assert [lp.token_id for lp in scored] == PROMPTS[1][1:]
            assert [lp.logprob for lp in scored] == pytest.approx(
                [float(reference[i - 1, t]) for i, t in enumerate(PROMPTS[1]) if i], abs=1e-4)
            assert all(len(lp.top) == 3 for lp in scored) and not any(c.prompt_logprobs for c in mine[1:])
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(pb.GenerateRequest(prompt="x", prompt_logprobs=21), timeout=60))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith("prompt_logprobs: ")


def test_the_client_collects_each_choices_prompt_logprobs(server) -> None:
    with TandemClient(server.address, timeout=60) as client:
        result = client.generate_result(token_ids=PROMPTS[0], n=2, temperature=0, max_tokens=4, prompt_logprobs=1)
        plain = client.generate_result(token_ids=PROMPTS[0], temperature=0, max_tokens=4)
    for choice in result.choices:
        assert [lp.token_id for lp in choice.prompt_logprobs] == PROMPTS[0][1:]
        assert all(len(lp.top) == 1 for lp in choice.prompt_logprobs)
    assert result.choices[0].prompt_logprobs == result.choices[1].prompt_logprobs
    assert plain.choices[0].prompt_logprobs is None and result.token_ids == plain.token_ids


def test_vllms_prompt_logprobs_field_on_both_endpoints(server, tiny_models) -> None:
    """vLLM's shape: None for the first token, then {token id: {logprob, rank, decoded_token}} holding the prompt's
    token (its rank among the vocabulary) and the most likely ones (ranks 1, 2, ...)."""
    reference = _plain_forward(tiny_models[0], PROMPTS[1])
    body = _post(server, {"prompt": PROMPTS[1], "prompt_logprobs": 2, "max_tokens": 2, "temperature": 0})
    scored = body["choices"][0]["prompt_logprobs"]
    assert len(scored) == len(PROMPTS[1]) and scored[0] is None
    for i, position in enumerate(scored[1:], 1):
        mine = position[str(PROMPTS[1][i])]
        assert mine["logprob"] == pytest.approx(float(reference[i - 1, PROMPTS[1][i]]), abs=1e-4)
        assert mine["rank"] == int((reference[i - 1] > reference[i - 1, PROMPTS[1][i]] + 1e-4).sum()) + 1
        assert sorted(e["rank"] for e in position.values())[:2] == [1, 2] and len(position) in (2, 3)
    chat = httpx.post(f"{server.gateway.http_url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 0, "max_tokens": 2})
    assert chat.status_code == 200, chat.text
    assert len(chat.json()["prompt_logprobs"]) == chat.json()["usage"]["prompt_tokens"]
    # With echo's logprobs beside, each keeps its own number of alternatives.
    both = _post(server, {"prompt": PROMPTS[1], "echo": True, "logprobs": 1, "prompt_logprobs": 3, "max_tokens": 1})
    choice = both["choices"][0]
    assert all(len(top) <= 2 for top in choice["logprobs"]["top_logprobs"][1:])
    assert all(len(position) >= 3 for position in choice["prompt_logprobs"][1:])
    streamed = httpx.post(f"{server.gateway.http_url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "x", "prompt_logprobs": 1, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"
    bad = httpx.post(f"{server.gateway.http_url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "x", "prompt_logprobs": 21})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"
