"""OpenAI's Responses API (POST /v1/responses) over the chat path: the openai SDK against a real gateway over the tiny
pair, every response and streamed event checked against the SDK's own types (strict validation), and the same
tokens as the chat API for the same conversation."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from gateway_harness import ServerThread, tiny_backend, window_past_budget

MODEL = "tiny-target"
EVENTS = TypeAdapter(ResponseStreamEvent)
CITY = {"type": "function", "name": "get_weather", "description": "The weather in a city now", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Lima"]}}}}
ANSWER = {"type": "object", "additionalProperties": False, "required": ["ok"],
          "properties": {"ok": {"type": "boolean"}}}
CHAT_TOOL = {"type": "function", "function": {key: CITY[key] for key in ("name", "description", "parameters")}}


def _call(call_id: str, city: str) -> dict:
    return {"id": call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.gateway.http_url}/v1/responses", json={"model": MODEL} | body, timeout=60)


def _whole(server, body: dict) -> dict:
    response = _post(server, body)
    assert response.status_code == 200, response.text
    Response.model_validate(response.json(), strict=True)
    return response.json()


def _streamed(server, body: dict) -> list[dict]:
    """Every event of a streamed response, each validated as the SDK's event type it names."""
    events = []
    with httpx.stream("POST", f"{server.gateway.http_url}/v1/responses", timeout=60,
                      json={"model": MODEL, "stream": True} | body) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: "):
                event = json.loads(line.removeprefix("data: "))
                assert event["type"] == kind
                EVENTS.validate_python(event, strict=True)
                events.append(event)
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    return events


def test_a_text_response_is_the_chat_apis_completion_whole_and_streamed(server, sdk) -> None:
    """The same conversation gives the same tokens through both APIs; max_output_tokens reached is `incomplete`,
    the streamed deltas join into the whole response's text, and the stream closes every item it opened."""
    asked = {"temperature": 0, "extra_body": {"ignore_eos": True}}
    chat = sdk.chat.completions.create(model=MODEL, max_tokens=12, **asked, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):"}])
    response = sdk.responses.create(model=MODEL, instructions="Be brief.", input="def add(a, b):",
                                    max_output_tokens=12, **asked)
    assert response.output_text == chat.choices[0].message.content
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (chat.usage.prompt_tokens, 12)
    assert response.id.startswith("resp_") and response.output[0].role == "assistant"
    body = {"instructions": "Be brief.", "input": "def add(a, b):", "max_output_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    assert _whole(server, body)["output"][0]["content"][0]["text"] == response.output_text
    events = _streamed(server, body)
    kinds = [event["type"] for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    deltas = "".join(event["delta"] for event in events if event["type"] == "response.output_text.delta")
    assert deltas == response.output_text == events[-4]["text"]
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == deltas
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []


def test_function_call_items_and_their_outputs_are_the_chat_apis_tool_turns(server, sdk) -> None:
    """An earlier turn's text and function calls (one assistant message) and the calls' outputs reach the chat
    template as the chat API's messages would: the same prompt, token for token (input_tokens)."""
    chat = sdk.chat.completions.create(model=MODEL, max_tokens=3, temperature=0, tools=[CHAT_TOOL], messages=[
        {"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.",
         "tool_calls": [_call("call_1", "Paris"), _call("call_2", "Rome")]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "21 C"}])
    response = sdk.responses.create(model=MODEL, max_output_tokens=3, temperature=0, tools=[CITY],
                                    instructions="Use tools.", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris and Rome?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        *({"type": "function_call", "call_id": call["id"], **call["function"]}
          for call in (_call("call_1", "Paris"), _call("call_2", "Rome"))),
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
        {"type": "function_call_output", "call_id": "call_2", "output": "21 C"}])
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.output_text == chat.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_call_is_a_function_call_item_its_schema_accepts(server, stream: bool) -> None:
    """tool_choice required: every output is a function_call item (no message), its arguments valid under the
    tool's parameters, the response `completed`; streamed, the item's arguments arrive in their own events. One call
    (parallel_tool_calls false): allowed more, the random model goes on to further calls until max_output_tokens."""
    body = {"input": "Weather?", "tools": [CITY], "tool_choice": "required", "max_output_tokens": 160,
            "temperature": 1.0, "parallel_tool_calls": False}
    for seed in (3, 4):
        if stream:
            events = _streamed(server, body | {"seed": seed})
            done = [e["arguments"] for e in events if e["type"] == "response.function_call_arguments.done"]
            added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
            assert [item["type"] for item in added] == ["function_call"] and added[0]["arguments"] == ""
            assert events[-1]["type"] == "response.completed"
            output = events[-1]["response"]["output"]
            assert done == [output[0]["arguments"]]
        else:
            response = _whole(server, body | {"seed": seed})
            assert response["status"] == "completed"
            output = response["output"]
        assert [item["type"] for item in output] == ["function_call"]
        call = output[0]
        assert call["name"] == "get_weather" and call["call_id"].startswith("call_") and call["id"].startswith("fc_")
        jsonschema.validate(json.loads(call["arguments"]), CITY["parameters"])


def test_text_format_json_schema_is_followed_whole_and_through_the_sdks_stream_helper(server, sdk) -> None:
    asked = {"model": MODEL, "input": "ok?", "max_output_tokens": 40, "temperature": 1.0, "extra_body": {"seed": 7},
             "text": {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}}}
    response = sdk.responses.create(**asked)
    assert response.status == "completed" and json.loads(response.output_text) in ({"ok": True}, {"ok": False})
    assert response.text.format.type == "json_schema"
    # The SDK's helper rebuilds the response from the events, raising where they do not fit together.
    with sdk.responses.stream(**asked) as stream:
        deltas = "".join(event.delta for event in stream if event.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas == final.output_text == response.output_text and final.status == "completed"


def test_logprobs_are_the_chat_apis_for_the_same_tokens(server, sdk) -> None:
    asked = {"temperature": 0, "extra_body": {"ignore_eos": True}}
    chat = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                       logprobs=True, top_logprobs=2, **asked)
    response = sdk.responses.create(model=MODEL, input="hi", max_output_tokens=6, top_logprobs=2,
                                    include=["message.output_text.logprobs"], **asked)
    got = [(lp.token, round(lp.logprob, 5), [t.token for t in lp.top_logprobs])
           for lp in response.output[0].content[0].logprobs]
    assert got == [(lp.token, round(lp.logprob, 5), [t.token for t in lp.top_logprobs])
                   for lp in chat.choices[0].logprobs.content]
    plain = sdk.responses.create(model=MODEL, input="hi", max_output_tokens=6, **asked)
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == response.output_text


@pytest.mark.parametrize(("change", "param"), [
    ({"conversation": 7}, "conversation"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c", "name": "get_weather",
                                                     "arguments": "[1]"}]}, "input[1].arguments"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"include": ["reasoning.encrypted_content"]}, "include[0]"),
    ({"n": 2}, "n"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "wat"}}}}, "text.format"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),  # OpenAI's limits: 16 pairs, values of 512
    ({"metadata": {"k": "v" * 513}}, "metadata"),
])
def test_requests_it_cannot_honour_are_400_naming_the_field(server, change: dict, param: str) -> None:
    response = _post(server, {"input": "hi", "max_output_tokens": 2} | change)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: "), error


def _idle(server: ServerThread) -> bool:
    return server.wait_for(lambda: server.gateway.loop.active == 0 and server.caches_empty())


def test_a_stream_the_client_leaves_is_cancelled(server) -> None:
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{server.gateway.http_url}/v1/responses", json=body, timeout=60) as response:
        lines = response.iter_lines()  # held: a dropped line iterator closes the response, and the client has left
        assert next(line for line in lines if '"response.output_text.delta"' in line)
        assert server.gateway.loop.active == 1
    assert _idle(server)


def test_a_refusal_mid_generation_fails_the_response(tiny_models) -> None:
    """A sequence that outgrows the whole KV budget, where a worker holds less than the window the gateway was told
    (elsewhere refused before it runs): a whole response is a 400 with the reason; a stream already under way ends
    with an error event and response.failed carrying it, and the failed response is stored."""
    small = ServerThread(window_past_budget(tiny_backend(tiny_models[0], None, kv_tokens=96)), http_port=0)
    body = {"input": "x" * 60, "max_output_tokens": 80, "ignore_eos": True, "temperature": 0}
    try:
        response = _post(small, body)
        assert response.status_code == 400 and "budget of 96" in response.json()["error"]["message"]
        events = _streamed(small, body)
        assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
        assert any(e["type"] == "response.output_text.delta" for e in events)
        failed = events[-1]["response"]
        assert failed["status"] == "failed" and "budget of 96" in failed["error"]["message"]
        assert events[-2]["code"] == "invalid_request_error" and "budget of 96" in events[-2]["message"]
        kept = httpx.get(f"{small.gateway.http_url}/v1/responses/{failed['id']}", timeout=60)  # stored, as OpenAI's are
        assert kept.status_code == 200, kept.text
        assert kept.json()["status"] == "failed" and kept.json()["error"] == failed["error"]
        assert _idle(small)
    finally:
        small.stop()
