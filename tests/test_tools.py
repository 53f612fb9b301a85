"""Tool calls through a served gateway: tools shown to the model through its chat template on both APIs, calls read
out of its output (forced by a format) on chat completions, the Responses API and gRPC, tool_choice and
parallel_tool_calls, requests refused naming the field, and calls' OpenAI and gRPC shapes. The parser's own tests, with
no server (calls read out of streamed text, code blocks, runs, a call begun in the prompt), are in
tests/test_tool_call_parsing.py."""

from __future__ import annotations

import json

import grpc
import httpx
import jsonschema
import openai
import pytest

from gateway_harness import tiny_http_server
from tandem.client import Collector, TandemClient
from tandem.core.stats import RequestStats
from tandem.gateway.events import ChoiceDelta, ChoiceEnd
from tandem.gateway.forced_calls import forced_call_start
from tandem.gateway.openai.responses import Responder
from tandem.gateway.openai.tokens import TokenTexts
from tandem.gateway.servicer import chunk_message, complete_message
from tandem.gateway.tools import ToolCall
from tandem.v1 import generation_pb2 as pb

MODEL = "tiny-target"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18 C, sunny"}]


# Two tagged calls, forced by a format: the random-weight model writes no call of its own accord.
PARIS_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}\n</tool_call>'
TWO_CALLS = PARIS_CALL + PARIS_CALL.replace("Paris", "Rome")


def test_text_after_a_call_comes_after_it_on_every_api(server) -> None:
    """The model writes text, a call, more text: the Responses API's items are a message, the call, a message, in
    that order, whole and streamed; a chat's content is both texts and its call the one call."""
    sdk = openai.OpenAI(base_url=f"{server.gateway.http_url}/v1", api_key="x", max_retries=0)
    written = "Hello " + PARIS_CALL + " bye"  # " b" comes in the speculative round that closes the call (k 4)
    asked = {"model": MODEL, "input": "Weather in Paris?", "max_output_tokens": 200, "temperature": 0,
             "tools": [{"type": "function", **WEATHER["function"]}],
             "extra_body": {"structured_outputs": {"regex": written}}}
    response = sdk.responses.create(**asked)
    assert [(item.type, getattr(item, "name", None) or item.content[0].text) for item in response.output] == [
        ("message", "Hello "), ("function_call", "get_weather"), ("message", " bye")]
    streamed = [event for event in sdk.responses.create(**asked, stream=True)]
    assert [item.type for item in streamed[-1].response.output] == ["message", "function_call", "message"]
    added = [event.item.type for event in streamed if event.type == "response.output_item.added"]
    assert added == ["message", "function_call", "message"]
    chat = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                       tools=[WEATHER], max_tokens=200, temperature=0,
                                       extra_body={"structured_outputs": {"regex": written}})
    message = chat.choices[0].message
    assert message.content == "Hello  bye" and [c.function.name for c in message.tool_calls] == ["get_weather"]


def test_a_streamed_call_sends_no_chunk_with_nothing_in_it(server) -> None:
    """While the parser reads a call it holds the text back; each step of it was streamed as a chunk of empty content
    (6 of 9 chunks of a real call), so a client adding up the deltas read content "" where the whole response says
    null. Now a chunk carries text, a call, the role or the end; with logprobs asked for, the held tokens' logprobs
    still each come in a chunk."""
    sdk = openai.OpenAI(base_url=f"{server.gateway.http_url}/v1", api_key="x", max_retries=0)
    asked = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER],
             "max_tokens": 200, "temperature": 0, "stream": True,
             "extra_body": {"structured_outputs": {"regex": PARIS_CALL}}}
    chunks = [chunk.choices[0] for chunk in sdk.chat.completions.create(**asked) if chunk.choices]
    empty = [c for c in chunks if not (c.delta.content or c.delta.tool_calls or c.delta.role or c.finish_reason)]
    assert not empty and chunks[-1].finish_reason == "tool_calls"
    assert [call.function.name for c in chunks for call in c.delta.tool_calls or []] == ["get_weather"]
    assert "".join(c.delta.content or "" for c in chunks) == ""
    scored = [chunk.choices[0] for chunk in sdk.chat.completions.create(**asked, logprobs=True) if chunk.choices]
    whole = sdk.chat.completions.create(**{**asked, "stream": False}, logprobs=True)
    held = [entry.token for c in scored if c.logprobs and c.logprobs.content for entry in c.logprobs.content]
    assert held == [entry.token for entry in whole.choices[0].logprobs.content] and held


def test_parallel_tool_calls_false_ends_the_output_at_its_first_call_on_every_api(server) -> None:
    """The same forced output gives two calls by default and one with parallel_tool_calls false (the request
    stopped there: fewer tokens, finish reason tool_calls, its caches freed), through chat completions, the Responses
    API and gRPC."""
    sdk = openai.OpenAI(base_url=f"{server.gateway.http_url}/v1", api_key="x", max_retries=0)
    asked = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris and Rome?"}],
             "tools": [WEATHER], "max_tokens": 200, "temperature": 0,
             "extra_body": {"structured_outputs": {"regex": TWO_CALLS}}}
    both = sdk.chat.completions.create(**asked)
    assert [json.loads(c.function.arguments)["city"] for c in both.choices[0].message.tool_calls] == ["Paris", "Rome"]
    one = sdk.chat.completions.create(**asked, parallel_tool_calls=False)
    assert [json.loads(c.function.arguments)["city"] for c in one.choices[0].message.tool_calls] == ["Paris"]
    assert one.choices[0].finish_reason == "tool_calls"
    assert one.usage.completion_tokens < both.usage.completion_tokens
    streamed = sdk.chat.completions.create(**asked, parallel_tool_calls=False, stream=True)
    chunks = list(streamed)
    calls = [call for chunk in chunks for choice in chunk.choices for call in choice.delta.tool_calls or ()]
    assert [json.loads(c.function.arguments)["city"] for c in calls] == ["Paris"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    response = sdk.responses.create(model=MODEL, input="Weather in Paris and Rome?", max_output_tokens=200,
                                    temperature=0, parallel_tool_calls=False, extra_body={
                                        "structured_outputs": {"regex": TWO_CALLS}},
                                    tools=[{"type": "function", **WEATHER["function"]}])
    assert [item.type for item in response.output] == ["function_call"] and response.status == "completed"
    with TandemClient(server.address, timeout=60) as client:
        result = client.generate_result(chat=[("user", "Weather in Paris and Rome?")], tools=[WEATHER],
                                        max_tokens=200, temperature=0, parallel_tool_calls=False,
                                        response_format={"type": "regex", "regex": TWO_CALLS})
        assert [c.name for c in result.choices[0].tool_calls] == ["get_weather"]
        assert result.choices[0].finish_reason == "tool_calls"
    assert server.wait_for(lambda: server.gateway.loop.active == 0 and server.caches_empty())


@pytest.fixture(scope="module")
def server(tiny_models):
    yield from tiny_http_server(tiny_models, max_prompt_tokens=2048)


def test_tools_and_earlier_calls_reach_the_chat_template_on_both_apis(server, tiny_models) -> None:
    tokenizer = tiny_models[0].tokenizer
    with TandemClient(server.address, timeout=60) as client:
        shown = client.tokenize(chat=HISTORY, tools=[WEATHER])
        plain = client.tokenize(chat=HISTORY)
        prompt = tokenizer.decode(shown)
        assert json.dumps(WEATHER) in prompt and '"arguments": {"city": "Paris"}' in prompt
        assert "18 C, sunny" in prompt and json.dumps(WEATHER) not in tokenizer.decode(plain)
        result = client.generate_result(chat=HISTORY, tools=[WEATHER], max_tokens=4, temperature=0, ignore_eos=True)
        assert result.usage.prompt_tokens == len(shown) and result.finish_reason == "length"
        assert result.choices[0].tool_calls == []  # random weights write no call
        hidden = client.generate_result(chat=HISTORY, tools=[WEATHER], tool_choice="none", max_tokens=1)
        assert hidden.usage.prompt_tokens == len(plain)
    sdk = openai.OpenAI(base_url=f"{server.gateway.http_url}/v1", api_key="x", max_retries=0)
    response = sdk.chat.completions.create(model=MODEL, messages=HISTORY, tools=[WEATHER], tool_choice="auto",
                                           max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert response.usage.prompt_tokens == len(shown) and response.choices[0].message.tool_calls is None


def test_a_required_or_named_tool_choice_is_served_on_both_apis(server, tiny_models) -> None:
    tokenizer = tiny_models[0].tokenizer
    named = {"type": "function", "function": {"name": "get_weather"}}
    sdk = openai.OpenAI(base_url=f"{server.gateway.http_url}/v1", api_key="x", max_retries=0)
    usage = {}
    for name, choice in (("auto", "auto"), ("required", "required"), ("named", named)):
        response = sdk.chat.completions.create(model=MODEL, messages=HISTORY, tools=[WEATHER], tool_choice=choice,
                                               max_tokens=3, temperature=0)
        usage[name] = response.usage.prompt_tokens
    for name, choice in (("required", "required"), ("named", "function:get_weather")):
        start = forced_call_start(pb.Chat(tools=[pb.Tool(name="get_weather")], tool_choice=choice))
        assert usage[name] == usage["auto"] + len(tokenizer.encode(start, add_special_tokens=False))
    with TandemClient(server.address, timeout=60) as client:
        result = client.generate_result(chat=HISTORY, tools=[WEATHER], tool_choice="function:get_weather",
                                        max_tokens=3, temperature=0)
        assert result.usage.prompt_tokens == usage["named"]


# Bounded arguments: a random-weight model fills whatever room a schema leaves.
CITY = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Lima"]}}}}}
ZONE = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone", "hours"],
    "properties": {"zone": {"type": "string", "maxLength": 5, "pattern": "^[A-Z]+$"},
                   "hours": {"type": "integer", "minimum": 0, "maximum": 23}}}}}


@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_required_or_named_call_is_always_a_call_with_arguments_its_schema_accepts(server, tiny_models,
                                                                                     choice: str) -> None:
    """The random-weight model writes no call of its own accord (auto: no choice is one); with the call's format
    masking its output after the begun call, every choice is a call of an offered tool (the named one), its
    arguments valid under that tool's parameters. Speculation stays on. One call a choice (parallel_tool_calls
    false): the random model would go on to more calls until max_tokens (the next test)."""
    sdk = openai.OpenAI(base_url=f"{server.gateway.http_url}/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "Weather or time?"}]
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_time"}}
    asked = {"model": MODEL, "messages": messages, "tools": [CITY, ZONE], "n": 6, "max_tokens": 160,
             "temperature": 1.0, "seed": 5, "parallel_tool_calls": False}
    free = sdk.chat.completions.create(**asked, tool_choice="auto")
    assert not any(c.message.tool_calls for c in free.choices)
    response = sdk.chat.completions.create(**asked, tool_choice=tool_choice)
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (CITY, ZONE)}
    names = set()
    for c in response.choices:
        assert c.finish_reason == "tool_calls" and not c.message.content and len(c.message.tool_calls) == 1
        call = c.message.tool_calls[0].function
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        names.add(call.name)
    assert names == {"get_time"} if choice == "named" else names <= {"get_weather", "get_time"}
    with TandemClient(server.address, timeout=60) as client:
        result = client.generate_result(chat=messages, tools=[CITY, ZONE], tool_choice="function:get_weather",
                                        max_tokens=160, temperature=1.0, seed=9)
    calls = result.choices[0].tool_calls
    assert result.finish_reason == "tool_calls" and [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments_json)["city"] in {"Paris", "Rome", "Lima"}
    # Cut by max_tokens inside the call: what the model wrote comes out as text, not the call's start the prompt
    # wrote (its tags and the name), so the text is the output's tokens.
    cut = sdk.chat.completions.create(**{**asked, "n": 1, "max_tokens": 2}, tool_choice=tool_choice,
                                      extra_body={"return_token_ids": True})
    choice_out = cut.choices[0]
    assert choice_out.finish_reason == "length" and not choice_out.message.tool_calls
    assert choice_out.message.content == tiny_models[0].tokenizer.decode(choice_out.model_extra["token_ids"])


def test_a_required_choice_makes_parallel_calls_unless_parallel_tool_calls_is_false(server, tiny_models) -> None:
    """With the end of the output banned (logit_bias on the EOS tokens), "required" goes on from one call to the
    next, each a call of an offered tool in tags of its own with arguments its schema accepts, until max_tokens cuts
    it; with parallel_tool_calls false the format ends the output after the first call, ban or no ban."""
    tokenizer = tiny_models[0].tokenizer
    ends = {str(tokenizer.convert_tokens_to_ids(token)): -100 for token in ("<|endoftext|>", "<|im_end|>")}
    sdk = openai.OpenAI(base_url=f"{server.gateway.http_url}/v1", api_key="x", max_retries=0)
    asked = {"model": MODEL, "messages": [{"role": "user", "content": "Weather or time?"}], "tools": [CITY, ZONE],
             "tool_choice": "required", "max_tokens": 300, "temperature": 1.0, "seed": 4, "logit_bias": ends,
             "extra_body": {"return_token_ids": True}}
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (CITY, ZONE)}
    parallel = sdk.chat.completions.create(**asked).choices[0]
    assert parallel.finish_reason == "length" and len(parallel.message.tool_calls) >= 2, parallel
    for tool_call in parallel.message.tool_calls:
        jsonschema.validate(json.loads(tool_call.function.arguments), schemas[tool_call.function.name])
    text = tokenizer.decode(parallel.model_extra["token_ids"])
    assert text.count("</tool_call>\n<tool_call>\n{\"name\": ") >= 1, text
    single = sdk.chat.completions.create(**asked | {"parallel_tool_calls": False}).choices[0]
    assert single.finish_reason == "tool_calls" and len(single.message.tool_calls) == 1, single
    jsonschema.validate(json.loads(single.message.tool_calls[0].function.arguments),
                        schemas[single.message.tool_calls[0].function.name])


@pytest.mark.parametrize(("change", "param"), [
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "required", "ignore_eos": True}, "ignore_eos"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "wat"}}}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].name"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages[0].tool_calls[0].arguments"),
])
def test_tool_requests_it_cannot_honour_are_400_naming_the_field(server, change: dict, param: str) -> None:
    body = {"model": MODEL, "messages": HISTORY, "tools": [WEATHER], "max_tokens": 2} | change
    response = httpx.post(f"{server.gateway.http_url}/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: ")


def test_grpc_refuses_a_tool_choice_it_cannot_honour(server) -> None:
    with TandemClient(server.address, timeout=60) as client, pytest.raises(grpc.RpcError) as caught:
        client.generate_result(chat=HISTORY, tools=[WEATHER], tool_choice="any", max_tokens=2)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("chat.tool_choice:")


def test_calls_take_openai_and_grpc_shapes(tiny_models) -> None:
    """A choice whose text held a call, as the generate path hands it on: OpenAI's streamed delta (the call's index
    among the choice's calls), whole message (no content beside the calls) and finish reason; gRPC's chunk and
    Complete, and the Python client's result."""
    first, second = ToolCall("call_a", "get_weather", '{"city": "Paris"}'), ToolCall("call_b", "get_time", "{}")
    events = [ChoiceDelta(0, "\n", [1, 2], None, (first,)), ChoiceDelta(0, "", [3], None, (second,)),
              ChoiceEnd(0, "tool_calls", 5, 3, RequestStats().report(False, 0), "r1")]
    streamed = Responder("chat", "id", MODEL, TokenTexts(tiny_models[0].tokenizer), n=1)
    deltas = [streamed.chunk(event)["choices"][0] for event in events]
    assert deltas[0]["delta"]["tool_calls"] == [{"index": 0, "id": "call_a", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    assert deltas[1]["delta"]["tool_calls"][0]["index"] == 1 and deltas[2]["finish_reason"] == "tool_calls"
    whole = Responder("chat", "id", MODEL, TokenTexts(tiny_models[0].tokenizer), n=1)
    for event in events:
        whole.collect(event)
    message = whole.response()["choices"][0]["message"]
    assert message["content"] is None and [c["id"] for c in message["tool_calls"]] == ["call_a", "call_b"]
    collector = Collector()
    for event in events:
        item = chunk_message(event) if isinstance(event, ChoiceDelta) else complete_message(event)
        collector.add(item.chunk if item.HasField("chunk") else item.complete)
    result = collector.result()
    assert result.finish_reason == "tool_calls"
    assert [(c.name, c.arguments_json) for c in result.choices[0].tool_calls] == [
        ("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert complete_message(events[2]).complete.finish_reason == pb.FINISH_REASON_TOOL_CALLS
