"""Stored responses of the Responses API: `store`, previous_response_id, GET/DELETE /v1/responses/{id} and its
input_items, through the openai SDK against a real gateway over the tiny pair (float32, greedy): a continued response
is the response to the whole conversation sent at once, token for token; and through a real Redis, one gateway
continues what another stored."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseItem
from pydantic import TypeAdapter

from gateway_harness import ServerThread, openai_sdk, tiny_backend, user_message
from tandem.sessions import EmbeddedRedis, open_session_store

MODEL = "tiny-target"
ITEMS = TypeAdapter(ResponseItem)
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
CITY = {"type": "function", "name": "get_weather", "description": "The weather in a city now", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Lima"]}}}}


def test_a_continued_response_is_the_whole_conversation_sent_at_once(sdk) -> None:
    """previous_response_id puts the stored conversation and output before the new input (its instructions are not
    carried over): the same prompt (input_tokens) and tokens as sending it all; GET returns the stored response, and
    input_items the conversation it answered, each item of the SDK's types."""
    first = sdk.responses.create(model=MODEL, instructions="Be brief.", input="def add(a, b):", max_output_tokens=6,
                                 **GREEDY)
    assert first.store is True and first.previous_response_id is None
    second = sdk.responses.create(model=MODEL, previous_response_id=first.id, input="Now in C.",
                                  max_output_tokens=6, **GREEDY)
    whole = sdk.responses.create(model=MODEL, max_output_tokens=6, store=False, **GREEDY, input=[
        user_message("def add(a, b):"),
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
        user_message("Now in C.")])
    assert second.previous_response_id == first.id and second.instructions is None
    assert second.usage.input_tokens == whole.usage.input_tokens > first.usage.input_tokens
    assert second.output_text == whole.output_text
    assert sdk.responses.retrieve(first.id).model_dump() == first.model_dump()
    items = sdk.responses.input_items.list(second.id, order="asc").data
    assert [(item.type, item.role) for item in items] == [("message", "user"), ("message", "assistant"),
                                                          ("message", "user")]
    assert [item.content[0].text for item in items] == ["def add(a, b):", first.output_text, "Now in C."]
    assert items[1].id == first.output[0].id  # the stored output, as it was


def test_a_function_calls_output_continues_the_response_that_made_the_call(sdk) -> None:
    """The classic tool loop: a forced call, then only its output sent with previous_response_id; the model sees
    the call and its output as if the whole conversation had been sent (same input_tokens and text)."""
    asked = {"tools": [CITY], "max_output_tokens": 4, **GREEDY}
    call_turn = sdk.responses.create(model=MODEL, input="Weather in Paris?", tool_choice="required", tools=[CITY],
                                     max_output_tokens=160, temperature=1.0, extra_body={"seed": 3})
    call = next(item for item in call_turn.output if item.type == "function_call")
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome", "Lima")
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}
    continued = sdk.responses.create(model=MODEL, previous_response_id=call_turn.id, input=[output], **asked)
    whole = sdk.responses.create(model=MODEL, store=False, **asked, input=[
        user_message("Weather in Paris?"),
        *({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": item.content[0].text}]}
          if item.type == "message" else
          {"type": "function_call", "call_id": item.call_id, "name": item.name, "arguments": item.arguments}
          for item in call_turn.output),
        output])
    assert continued.usage.input_tokens == whole.usage.input_tokens
    assert continued.output_text == whole.output_text


def test_store_false_deleted_and_unknown_responses_are_not_found(sdk, server) -> None:
    kept = sdk.responses.create(model=MODEL, input="hi", max_output_tokens=2, **GREEDY)
    unkept = sdk.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False, **GREEDY)
    assert unkept.store is False
    for missing in (unkept.id, "resp_nothing"):
        with pytest.raises(openai.NotFoundError):
            sdk.responses.retrieve(missing)
        with pytest.raises(openai.NotFoundError) as refused:
            sdk.responses.create(model=MODEL, input="and?", previous_response_id=missing, max_output_tokens=2)
        assert refused.value.body["code"] == "previous_response_not_found"
        assert refused.value.body["param"] == "previous_response_id"
    unclear = httpx.get(f"{server.gateway.http_url}/v1/responses/{kept.id}?stream=maybe", timeout=10)
    assert unclear.status_code == 400 and unclear.json()["error"]["param"] == "stream"  # was read as false
    deleted = httpx.delete(f"{server.gateway.http_url}/v1/responses/{kept.id}", timeout=10)
    assert deleted.status_code == 200 and deleted.json() == {"id": kept.id, "object": "response", "deleted": True}
    for gone in (httpx.get(f"{server.gateway.http_url}/v1/responses/{kept.id}", timeout=10),
                 httpx.delete(f"{server.gateway.http_url}/v1/responses/{kept.id}", timeout=10)):
        assert gone.status_code == 404 and gone.json()["error"]["message"] == f"Response with id '{kept.id}' not found."


def test_a_streamed_response_is_stored_before_its_last_event(server) -> None:
    """A client that continues a stream as soon as response.completed arrives finds it stored, as it was sent."""
    url = f"{server.gateway.http_url}/v1/responses"
    body = {"model": MODEL, "input": "def add(a, b):", "max_output_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        last = None
        for line in response.iter_lines():
            if line.startswith("data: "):
                last = json.loads(line.removeprefix("data: "))
                if last["type"] in ("response.completed", "response.incomplete"):
                    stored = httpx.get(f"{url}/{last['response']['id']}", timeout=10)  # before the stream ends
                    assert stored.status_code == 200 and stored.json() == last["response"]
                    Response.model_validate(stored.json(), strict=True)
    assert last is not None and last["response"]["store"] is True


def test_input_items_are_listed_a_page_at_a_time(sdk, server) -> None:
    first = sdk.responses.create(model=MODEL, input=[user_message("one"), user_message("two")], max_output_tokens=2,
                                 **GREEDY)
    second = sdk.responses.create(model=MODEL, previous_response_id=first.id, input=[user_message("three")],
                                  max_output_tokens=2, **GREEDY)
    url = f"{server.gateway.http_url}/v1/responses/{second.id}/input_items"
    newest = httpx.get(url, params={"limit": 2}, timeout=10).json()
    for item in newest["data"]:
        ITEMS.validate_python(item, strict=True)
    assert newest["data"][0]["content"][0]["text"] == "three" and newest["has_more"] is True
    assert newest["data"][1]["role"] == "assistant" and newest["last_id"] == newest["data"][1]["id"]
    rest = httpx.get(url, params={"limit": 2, "after": newest["last_id"]}, timeout=10).json()
    assert [item["content"][0]["text"] for item in rest["data"]] == ["two", "one"] and rest["has_more"] is False
    for bad, param in (({"limit": 0}, "limit"), ({"order": "up"}, "order"), ({"after": "msg_x"}, "after")):
        refused = httpx.get(url, params=bad, timeout=10)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param


def test_another_gateway_continues_a_response_through_redis_until_its_ttl(tiny_models) -> None:
    """Two gateways over one real Redis: what one stored, the other reads, continues and deletes; a response past
    --response-ttl is gone (Redis expired it)."""
    target, draft, _ = tiny_models
    with EmbeddedRedis() as redis:
        gateways = [ServerThread(tiny_backend(target, draft), http_port=0, sessions=open_session_store(redis.url),
                                 response_ttl_s=ttl) for ttl in (60.0, 2.0)]
        try:
            one, other = (openai_sdk(gateway) for gateway in gateways)
            first = one.responses.create(model=MODEL, input="def add(a, b):", max_output_tokens=4, **GREEDY)
            assert other.responses.retrieve(first.id).model_dump() == first.model_dump()
            second = other.responses.create(model=MODEL, previous_response_id=first.id, input="Again.",
                                            max_output_tokens=4, **GREEDY)
            assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
            assert one.responses.retrieve(second.id).previous_response_id == first.id  # stored for 2 s by `other`
            time.sleep(2.5)
            with pytest.raises(openai.NotFoundError):
                one.responses.retrieve(second.id)
            other.responses.delete(first.id)
            with pytest.raises(openai.NotFoundError):
                one.responses.retrieve(first.id)
        finally:
            for gateway in gateways:
                gateway.stop()


def test_a_server_storing_nothing_says_so(tiny_models) -> None:
    target, draft, _ = tiny_models
    gateway = ServerThread(tiny_backend(target, draft), http_port=0, response_ttl_s=0)
    try:
        sdk = openai_sdk(gateway)
        response = sdk.responses.create(model=MODEL, input="hi", max_output_tokens=2, **GREEDY)
        assert response.store is False
        with pytest.raises(openai.NotFoundError):
            sdk.responses.retrieve(response.id)
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.responses.create(model=MODEL, input="and?", previous_response_id=response.id, max_output_tokens=2)
        assert refused.value.body["param"] == "previous_response_id" and "--response-ttl 0" in str(refused.value)
    finally:
        gateway.stop()


def test_input_tokens_counts_what_a_response_would_be_given(sdk) -> None:
    """responses.input_tokens.count: the usage.input_tokens of the response the same body gets, instructions, tools
    and a continued conversation included, without generating; an unknown previous response is a 404 as on create."""
    asked = {"model": MODEL, "instructions": "Be brief.", "tools": [CITY], "input": "Weather in Paris?"}
    counted = sdk.responses.input_tokens.count(**asked)
    first = sdk.responses.create(**asked, max_output_tokens=3, **GREEDY)
    assert counted.object == "response.input_tokens" and counted.input_tokens == first.usage.input_tokens
    assert sdk.responses.input_tokens.count(model=MODEL, input="Weather in Paris?").input_tokens < counted.input_tokens
    more = {"previous_response_id": first.id, "input": "And in Rome?"}
    later = sdk.responses.create(model=MODEL, **more, max_output_tokens=2, **GREEDY)
    assert sdk.responses.input_tokens.count(model=MODEL, **more).input_tokens == later.usage.input_tokens
    alone = sdk.responses.input_tokens.count(model=MODEL, previous_response_id=first.id).input_tokens
    asked_alone = sdk.responses.input_tokens.count(model=MODEL, input="Weather in Paris?").input_tokens
    assert asked_alone < alone < later.usage.input_tokens  # the conversation and its output (no tools carried over)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.input_tokens.count(model=MODEL, input="hi", previous_response_id="resp_nothing")
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.responses.input_tokens.count(model=MODEL, input=[{"type": "message", "role": "wizard", "content": "x"}])
    assert refused.value.body["param"].startswith("input[0]")


def _assistant(text: str) -> dict:
    return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}


def test_truncation_auto_drops_the_fewest_oldest_turns_that_let_the_prompt_fit(sdk) -> None:
    """Three turns of ~900 tokens are past the server's 2048: refused by default; with truncation "auto" the first
    turn is dropped (only it: the prompt is then that of the last two turns sent alone, token for token, and so is
    the output), input_tokens.count agrees, and a last turn too long by itself is still refused."""
    long = [f"Turn {turn}: " + "lorem ipsum " * 75 for turn in range(3)]  # ~900 tokens each (12 a repeat)
    turns = [user_message(long[0]), _assistant("ok"), user_message(long[1]), _assistant("ok"),
             user_message(long[2] + " Sum up.")]
    asked = {"model": MODEL, "max_output_tokens": 4, **GREEDY}
    with pytest.raises(openai.BadRequestError, match="more than the limit of 2048"):
        sdk.responses.create(input=turns, **asked)
    fitted = sdk.responses.create(input=turns, truncation="auto", **asked)
    last_two = sdk.responses.create(input=turns[2:], store=False, **asked)
    assert fitted.truncation == "auto" and fitted.status == "incomplete"
    assert fitted.usage.input_tokens == last_two.usage.input_tokens <= 2048
    assert fitted.output_text == last_two.output_text
    assert sdk.responses.input_tokens.count(model=MODEL, input=turns, truncation="auto").input_tokens \
        == fitted.usage.input_tokens
    continued = sdk.responses.create(previous_response_id=fitted.id, input="And?", truncation="auto", **asked)
    assert continued.usage.input_tokens > fitted.usage.input_tokens  # what it kept, then the new turn: it fits
    with pytest.raises(openai.BadRequestError, match="more than the limit of 2048"):
        sdk.responses.create(input=[user_message("lorem ipsum " * 200)], truncation="auto", **asked)


def test_truncation_auto_rescues_a_conversation_past_the_message_limit(tiny_models) -> None:
    """Counting the whole conversation first was refused past the gateway's message (or byte) limit, so a
    conversation grown past it was a 400 for every later response, truncation "auto" or not."""
    from tandem.gateway.validate import GatewayLimits

    target, draft, _ = tiny_models
    gateway = ServerThread(tiny_backend(target, draft), http_port=0, limits=GatewayLimits(max_chat_messages=8))
    try:
        sdk = openai_sdk(gateway)
        items = [item for n in range(6) for item in (user_message(f"question {n}"), _assistant(f"answer {n}"))]
        conversation = sdk.conversations.create(items=items)
        asked = {"model": MODEL, "max_output_tokens": 2, "conversation": conversation.id, **GREEDY}
        with pytest.raises(openai.BadRequestError, match="at most 8"):
            sdk.responses.create(input="And now?", **asked)
        fitted = sdk.responses.create(input="And now?", truncation="auto", **asked)
        alone = sdk.responses.create(model=MODEL, max_output_tokens=2, store=False, **GREEDY,
                                     input=[*items[6:], user_message("And now?")])
        assert fitted.usage.input_tokens == alone.usage.input_tokens  # the newest turns that fit 8 messages
    finally:
        gateway.stop()
