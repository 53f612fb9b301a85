"""The Conversations API through the openai SDK against a real gateway over the tiny pair (float32, greedy): a
conversation's items and metadata, and responses created in it, which read its items as their history and add their
input and output once finished; the same prompt, token for token, as the whole conversation sent at once."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from openai.types.conversations import Conversation, ConversationItem
from pydantic import TypeAdapter

from gateway_harness import ServerThread, openai_sdk, tiny_backend, user_message
from tandem.sessions import EmbeddedRedis, open_session_store, redis_store

MODEL = "tiny-target"
ITEMS = TypeAdapter(ConversationItem)
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def _texts(items) -> list[tuple[str, str]]:
    return [(item.role, item.content[0].text) for item in items]


def test_a_conversations_items_and_metadata(sdk) -> None:
    conversation = sdk.conversations.create(items=[user_message("one"), {"role": "assistant", "content": "two"}],
                                            metadata={"topic": "count"})
    Conversation.model_validate(conversation.model_dump(), strict=True)
    assert conversation.id.startswith("conv_") and conversation.metadata == {"topic": "count"}
    assert sdk.conversations.retrieve(conversation.id).model_dump() == conversation.model_dump()
    added = sdk.conversations.items.create(conversation.id, items=[user_message("three")])
    assert _texts(added.data) == [("user", "three")]
    listed = sdk.conversations.items.list(conversation.id, order="asc")
    assert _texts(listed.data) == [("user", "one"), ("assistant", "two"), ("user", "three")]
    for item in listed.data:
        ITEMS.validate_python(item.model_dump(), strict=True)
    newest = sdk.conversations.items.list(conversation.id, limit=1)
    assert _texts(newest.data) == [("user", "three")] and newest.has_more is True
    second = listed.data[1]
    assert sdk.conversations.items.retrieve(second.id, conversation_id=conversation.id).model_dump() \
        == second.model_dump()
    sdk.conversations.items.delete(second.id, conversation_id=conversation.id)
    assert _texts(sdk.conversations.items.list(conversation.id, order="asc").data) == [("user", "one"),
                                                                                     ("user", "three")]
    with pytest.raises(openai.NotFoundError):
        sdk.conversations.items.retrieve(second.id, conversation_id=conversation.id)
    updated = sdk.conversations.update(conversation.id, metadata={"topic": "numbers"})
    assert updated.metadata == {"topic": "numbers"} and updated.created_at == conversation.created_at
    deleted = sdk.conversations.delete(conversation.id)
    assert deleted.deleted is True and deleted.id == conversation.id
    for gone in (lambda: sdk.conversations.retrieve(conversation.id),
                 lambda: sdk.conversations.items.list(conversation.id)):
        with pytest.raises(openai.NotFoundError):
            gone()


def test_responses_in_a_conversation_read_and_extend_it(sdk) -> None:
    """Two turns in a conversation: each sees the conversation so far (the same input tokens and text as the whole
    conversation sent at once), and the conversation then holds each turn's input and output, in order."""
    conversation = sdk.conversations.create(items=[user_message("def add(a, b):")])
    asked = {"model": MODEL, "max_output_tokens": 5, **GREEDY}
    first = sdk.responses.create(conversation=conversation.id, input="Now in C.", **asked)
    assert first.conversation.id == conversation.id
    whole = sdk.responses.create(input=[user_message("def add(a, b):"), user_message("Now in C.")], store=False,
                                 **asked)
    assert first.usage.input_tokens == whole.usage.input_tokens and first.output_text == whole.output_text
    second = sdk.responses.create(conversation={"id": conversation.id}, input="And in Go?", stream=False, **asked)
    items = sdk.conversations.items.list(conversation.id, order="asc").data
    assert [(item.role, item.content[0].text) for item in items] == [
        ("user", "def add(a, b):"), ("user", "Now in C."), ("assistant", first.output_text), ("user", "And in Go?"),
        ("assistant", second.output_text)]
    assert items[2].id == first.output[0].id
    whole = sdk.responses.create(store=False, **asked, input=[
        user_message("def add(a, b):"), user_message("Now in C."),
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
        user_message("And in Go?")])
    assert second.usage.input_tokens == whole.usage.input_tokens and second.output_text == whole.output_text
    counted = sdk.responses.input_tokens.count(model=MODEL, conversation=conversation.id, input="More?")
    assert counted.input_tokens > second.usage.input_tokens + second.usage.output_tokens


def test_a_streamed_and_a_background_response_extend_the_conversation_once_finished(sdk) -> None:
    conversation = sdk.conversations.create()
    asked = {"model": MODEL, "max_output_tokens": 4, **GREEDY}
    with sdk.responses.stream(conversation=conversation.id, input="hi", **asked) as stream:
        events = list(stream)
    streamed = events[-1].response
    started = sdk.responses.create(conversation=conversation.id, input="again", background=True, **asked)
    assert started.conversation.id == conversation.id
    deadline = time.monotonic() + 60
    while (done := sdk.responses.retrieve(started.id)).status not in ("completed", "incomplete", "failed"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    items = sdk.conversations.items.list(conversation.id, order="asc").data
    assert [item.content[0].text for item in items] == ["hi", streamed.output_text, "again", done.output_text]


def test_what_a_conversation_refuses(sdk, server) -> None:
    conversation = sdk.conversations.create()
    first = sdk.responses.create(model=MODEL, input="hi", max_output_tokens=2, **GREEDY)
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.responses.create(model=MODEL, input="hi", conversation=conversation.id, previous_response_id=first.id)
    assert refused.value.body["param"] == "conversation"
    with pytest.raises(openai.NotFoundError) as unknown:
        sdk.responses.create(model=MODEL, input="hi", conversation="conv_nothing")
    assert unknown.value.body["param"] == "conversation"
    with pytest.raises(openai.BadRequestError) as bad_item:
        sdk.conversations.items.create(conversation.id, items=[{"type": "message", "role": "wizard", "content": "x"}])
    assert bad_item.value.body["param"] == "items[0].role"
    with pytest.raises(openai.BadRequestError):
        sdk.conversations.create(items=[user_message(str(index)) for index in range(21)])
    with pytest.raises(openai.BadRequestError) as metadata:
        sdk.conversations.create(metadata={"k": 1})
    assert metadata.value.body["param"] == "metadata"
    failed = httpx.post(f"{server.gateway.http_url}/v1/responses", timeout=60, json={
        "model": MODEL, "input": "x " * 3000, "conversation": conversation.id, "max_output_tokens": 2})
    assert failed.status_code == 400
    assert sdk.conversations.items.list(conversation.id).data == []  # a refused response adds nothing


def test_item_ids_are_unique_so_a_page_after_one_ends(sdk) -> None:
    """A client's item ids are kept: two items with one id made listing `after` it return the same page for ever
    (the SDK's auto-pagination never ended) and a delete of one remove both. OpenAI refuses them, as here."""
    twin = {"id": "msg_twin", "type": "message", "role": "user", "content": "x"}
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.conversations.create(items=[twin, twin])
    assert "Duplicate item found with id msg_twin" in refused.value.body["message"]
    conversation = sdk.conversations.create(items=[twin])
    with pytest.raises(openai.BadRequestError):
        sdk.conversations.items.create(conversation.id, items=[twin])
    with pytest.raises(openai.BadRequestError) as continued:  # the input repeating an item of the conversation
        sdk.responses.create(model=MODEL, input=[twin], conversation=conversation.id, max_output_tokens=2)
    assert continued.value.body["param"] == "input"
    first = sdk.responses.create(model=MODEL, input=[twin], max_output_tokens=2, **GREEDY)
    with pytest.raises(openai.BadRequestError):  # ... or of the response it continues, output items included
        sdk.responses.create(model=MODEL, previous_response_id=first.id, max_output_tokens=2,
                             input=[{"id": first.output[0].id, "type": "message", "role": "assistant", "content": "y"}])
    assert [item.id for item in sdk.conversations.items.list(conversation.id)] == ["msg_twin"]


def test_another_gateway_reads_and_extends_a_conversation_through_redis(tiny_models, monkeypatch) -> None:
    target, draft, _ = tiny_models
    with EmbeddedRedis() as redis:
        gateways = [ServerThread(tiny_backend(target, draft), http_port=0, sessions=open_session_store(redis.url))
                    for _ in range(2)]
        try:
            one, other = (openai_sdk(gateway) for gateway in gateways)
            conversation = one.conversations.create(items=[user_message("def add(a, b):")])
            response = other.responses.create(model=MODEL, conversation=conversation.id, input="Now in C.",
                                              max_output_tokens=3, **GREEDY)
            items = one.conversations.items.list(conversation.id, order="asc").data
            assert [item.content[0].text for item in items] == ["def add(a, b):", "Now in C.", response.output_text]
            with ThreadPoolExecutor(4) as pool:  # both replicas adding to it at once: every item lands
                added = [f"{i}-{n}" for i in range(4) for n in range(5)]
                list(pool.map(lambda text, sdk: sdk.conversations.items.create(conversation.id,
                                                                               items=[user_message(text)]),
                              added, [one, other] * 10))
            items = other.conversations.items.list(conversation.id, order="asc", limit=100).data
            assert sorted(item.content[0].text for item in items[3:]) == sorted(added)
            # A change other writers beat on every try is a 409 (the SDKs retry it), and changes nothing.
            monkeypatch.setattr(redis_store, "MAX_UPDATE_TRIES", 0)
            with pytest.raises(openai.ConflictError, match="nothing was changed, retry"):
                one.conversations.items.create(conversation.id, items=[user_message("lost")])
            monkeypatch.undo()
            assert len(one.conversations.items.list(conversation.id, limit=100).data) == len(items)
            # Redis stalled: a change is a 503 (the SDKs retry it), not one made in a replica's memory that another
            # replica's change would overwrite at the write-back.
            os.kill(redis.pid, signal.SIGSTOP)
            for sdk in (one, other):
                with pytest.raises(openai.InternalServerError) as away:
                    sdk.with_options(max_retries=0).conversations.items.create(
                        conversation.id, items=[user_message("while away")])
                assert away.value.status_code == 503 and away.value.body["code"] == "store_unavailable"
            os.kill(redis.pid, signal.SIGCONT)
            deadline = time.monotonic() + 30

            def once_back(call):  # each replica finds Redis back at its next try (it backs off while it is away)
                while True:
                    try:
                        return call()
                    except openai.InternalServerError:
                        assert time.monotonic() < deadline
                        time.sleep(0.2)

            once_back(lambda: one.conversations.items.create(conversation.id, items=[user_message("back")]))
            listed = once_back(lambda: other.conversations.items.list(conversation.id, limit=100).data)
            texts = [item.content[0].text for item in listed]
            assert "back" in texts and "while away" not in texts
        finally:
            for gateway in gateways:
                gateway.stop()


def test_a_conversation_deleted_while_its_response_runs_leaves_the_response_whole(sdk) -> None:
    conversation = sdk.conversations.create()
    started = sdk.responses.create(model=MODEL, conversation=conversation.id, input="hi", max_output_tokens=300,
                                   background=True, **GREEDY)
    sdk.conversations.delete(conversation.id)
    deadline = time.monotonic() + 60
    while (done := sdk.responses.retrieve(started.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert done.status == "incomplete" and done.usage.output_tokens == 300
    with pytest.raises(openai.NotFoundError):
        sdk.conversations.retrieve(conversation.id)
