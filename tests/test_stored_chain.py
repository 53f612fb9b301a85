"""Stored responses kept as what each added to the responses before it (gateway.openai.stored_chain): a chain's records
hold each item once, yet every response reads back, continues and deletes as when each held its whole conversation. Over
a real Redis and over memory."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import pytest
import redis as redis_client

from gateway_harness import ServerThread, openai_sdk, tiny_backend
from tandem.gateway.openai.errors import OpenAIError
from tandem.gateway.openai.stored import (
    RESPONSE_PREFIX,
    ResponseStore,
    StoredResponse,
    open_response_store,
    segment_key,
    store_beside,
    tenant_key,
)
from tandem.gateway.openai.stored_chain import Segment, chain_ids, conversation_of, new_segment_id, split
from tandem.sessions import EmbeddedRedis, MemorySessionStore, open_session_store

TENANT = "tenant-a"
TEXT = "x" * 400  # each item's text: a record holding earlier turns shows in its size


def message(item_id: str, role: str = "user") -> dict:
    part = "input_text" if role == "user" else "output_text"
    return {"id": item_id, "type": "message", "role": role, "content": [{"type": part, "text": f"{item_id} {TEXT}"}]}


def response(turn: int, previous: str | None) -> dict:
    return {"id": f"resp_{turn}", "object": "response", "status": "completed", "previous_response_id": previous,
            "output": [message(f"out_{turn}", "assistant")]}


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture(params=["redis", "memory"])
def backend(request, redis_url: str) -> Iterator[tuple[ResponseStore, object]]:
    """(a response store, the raw key-value store under it)."""
    if request.param == "redis":
        redis_client.Redis.from_url(redis_url).flushall()
        stored = open_response_store(open_session_store(redis_url), 60.0)
    else:
        stored = open_response_store(MemorySessionStore(), 60.0)
    yield stored, stored._store
    stored.close()


def continue_chain(stored: ResponseStore, turns: int, start: int = 0, previous: str | None = None) -> list[dict]:
    """`turns` responses, each continuing the one before (as the Responses API stores them); the last one's
    conversation as a client would have sent it whole."""
    conversation = asyncio.run(stored.history(TENANT, previous)) if previous else []
    for turn in range(start, start + turns):
        items = conversation + [message(f"in_{turn}")]
        asyncio.run(stored.put(TENANT, StoredResponse(response(turn, previous), items, previous)))
        previous = f"resp_{turn}"
        conversation = items + response(turn, None)["output"]
    return conversation


def head(raw, turn: int) -> dict | None:
    return raw.get(tenant_key(TENANT, f"resp_{turn}"))


def segment(raw, turn_head: dict) -> dict | None:
    return raw.get(segment_key(TENANT, turn_head["segment"]))


def record_bytes(raw, turn: int) -> int:
    found = head(raw, turn)
    return len(json.dumps(found)) + len(json.dumps(segment(raw, found)))


def test_a_chain_holds_each_item_once_and_reads_back_whole(backend) -> None:
    stored, raw = backend
    whole = continue_chain(stored, 40)
    # Each turn's records hold its input, its output and one more segment id than the last turn's (held whole, the
    # 40th turn's record would hold 79 items); 16 bytes for the longer numbers in its own ids and texts.
    assert record_bytes(raw, 39) - record_bytes(raw, 1) <= 38 * (len(new_segment_id()) + 1) + 16
    last = asyncio.run(stored.get(TENANT, "resp_39"))
    assert last.items + last.response["output"] == whole
    assert last.response == response(39, "resp_38")  # as stored, its output and keys' order included
    assert list(last.response) == list(response(39, "resp_38"))
    assert asyncio.run(stored.history(TENANT, "resp_39")) == whole
    middle = asyncio.run(stored.get(TENANT, "resp_20"))
    assert middle.items == whole[:2 * 20 + 1]


def test_a_deleted_response_is_gone_but_what_continues_it_still_reads_its_items(backend) -> None:
    stored, raw = backend
    whole = continue_chain(stored, 5)
    heads = {turn: head(raw, turn) for turn in range(5)}
    assert asyncio.run(stored.delete(TENANT, "resp_2"))
    assert asyncio.run(stored.get(TENANT, "resp_2")) is None and head(raw, 2) is None
    assert not asyncio.run(stored.delete(TENANT, "resp_2"))  # a second delete finds nothing
    with pytest.raises(OpenAIError) as raised:
        asyncio.run(stored.history(TENANT, "resp_2"))
    assert raised.value.status == 404
    assert asyncio.run(stored.history(TENANT, "resp_4")) == whole
    assert segment(raw, heads[2])["continued"]  # kept for resp_3 and resp_4
    # Its id is free again, and a response given it changes nothing that reads the old one's items.
    asyncio.run(stored.create(TENANT, StoredResponse(response(2, None), [message("in_x")])))
    assert asyncio.run(stored.get(TENANT, "resp_2")).items == [message("in_x")]
    assert asyncio.run(stored.history(TENANT, "resp_4")) == whole
    assert asyncio.run(stored.delete(TENANT, "resp_4"))  # a response nothing continues leaves nothing behind
    assert head(raw, 4) is None and segment(raw, heads[4]) is None


def test_truncation_and_a_history_not_from_the_chain_are_kept_exactly(backend) -> None:
    stored, raw = backend
    whole = continue_chain(stored, 3)
    truncated = whole[3:] + [message("in_3")]  # truncation auto dropped the oldest turns
    asyncio.run(stored.put(TENANT, StoredResponse(response(3, "resp_2"), truncated, "resp_2")))
    assert asyncio.run(stored.get(TENANT, "resp_3")).items == truncated
    assert segment(raw, head(raw, 3))["skip"] == 3
    edited = [{**whole[0], "content": [{"type": "input_text", "text": "changed"}]}, *whole[1:], message("in_4")]
    asyncio.run(stored.put(TENANT, StoredResponse(response(4, "resp_2"), edited, "resp_2")))
    assert asyncio.run(stored.get(TENANT, "resp_4")).items == edited
    assert segment(raw, head(raw, 4))["items"] == edited
    assert chain_ids(head(raw, 4)["chain"]) == [head(raw, turn)["segment"] for turn in range(3)]


def test_a_response_whose_predecessor_is_gone_is_kept_whole_and_one_whose_chain_broke_says_so(backend) -> None:
    stored, raw = backend
    whole = continue_chain(stored, 3)
    first = head(raw, 0)
    raw.delete(tenant_key(TENANT, "resp_2"))  # gone from the store (evicted, expired), not deleted by a client
    items = whole + [message("in_3")]
    asyncio.run(stored.put(TENANT, StoredResponse(response(3, "resp_2"), items, "resp_2")))
    assert head(raw, 3)["chain"] == ""
    assert asyncio.run(stored.get(TENANT, "resp_3")).items == items
    raw.delete(segment_key(TENANT, first["segment"]))
    broken = asyncio.run(stored.get(TENANT, "resp_1"))
    assert broken.response == response(1, "resp_0") and broken.items is None  # GET still answers
    with pytest.raises(OpenAIError) as raised:
        asyncio.run(stored.history(TENANT, "resp_1"))
    assert raised.value.status == 404 and raised.value.code == "previous_response_not_found"
    assert asyncio.run(stored.get(TENANT, "resp_0")) is None  # its own segment gone: not found


def test_records_stored_whole_before_segments_are_read_and_continued(backend) -> None:
    stored, raw = backend
    old = [message("in_0")]
    raw.put(tenant_key(TENANT, "resp_0"), {"response": response(0, None), "items": old})
    whole = continue_chain(stored, 2, start=1, previous="resp_0")
    assert asyncio.run(stored.get(TENANT, "resp_0")).items == old
    assert asyncio.run(stored.history(TENANT, "resp_2")) == whole
    assert segment(raw, head(raw, 1))["items"] == old + response(0, None)["output"] + [message("in_1")]
    assert chain_ids(head(raw, 2)["chain"]) == [head(raw, 1)["segment"]]


@pytest.mark.parametrize("kind", ["redis", "memory"])
def test_storing_a_response_keeps_its_chains_items_alive(kind: str, redis_url: str) -> None:
    raw = open_session_store(redis_url, 2.0) if kind == "redis" else MemorySessionStore(2.0)
    stored = ResponseStore(raw)
    try:
        continue_chain(stored, 2)
        first = head(raw, 0)
        for turn in range(2, 5):  # each 0.8 s after the last: the first records outlive their own TTL
            time.sleep(0.8)
            continue_chain(stored, 1, start=turn, previous=f"resp_{turn - 1}")
        assert asyncio.run(stored.get(TENANT, "resp_0")) is None  # its head lived its own TTL
        assert asyncio.run(stored.get(TENANT, "resp_4")).items[0]["id"] == "in_0"
        time.sleep(2.3)  # nothing stored since: the chain's items expire with its newest
        assert segment(raw, first) is None and head(raw, 4) is None
    finally:
        stored.close()


def test_a_segment_keeps_the_newest_suffix_of_what_came_before() -> None:
    before = [message("a"), message("b"), message("c")]
    assert split(before, before[1:] + [message("d")]) == (1, [message("d")])
    assert split(before, [message("d")]) == (3, [message("d")])
    reordered = [before[1], before[0], message("d")]
    assert split(before, reordered) == (3, reordered)
    segments = [Segment(0, [message("a")], [message("b")]), Segment(1, [message("c")], [message("d")])]
    assert conversation_of(segments) == [message("b"), message("c"), message("d")]


@pytest.mark.parametrize("kind", ["redis", "memory"])
def test_renewing_lengthens_ttls_and_never_shortens_one(kind: str, redis_url: str) -> None:
    """A replica whose TTL is shorter never shortens what another stored for longer; one read in a round trip."""
    if kind == "redis":
        short = open_session_store(redis_url, 1.0)
        open_session_store(redis_url, 30.0).put("kept", {"n": 1})
    else:
        short = MemorySessionStore(1.0)
        short.put_raw("kept", '{"n": 1}', ttl_s=30.0)
    short.put("renewed", {"n": 2})
    time.sleep(0.5)
    short.renew(["kept", "renewed", "never-stored"])
    time.sleep(0.8)  # past the short TTL from the put, within it from the renewal
    assert short.get_many(["kept", "renewed", "never-stored"]) == [{"n": 1}, {"n": 2}, None]
    time.sleep(0.5)
    assert short.get_many(["kept", "renewed"]) == [{"n": 1}, None]


def test_a_gateway_stores_what_each_turn_of_a_chain_or_a_conversation_adds(tiny_models, redis_url: str) -> None:
    """Through the HTTP API: the third response of a previous_response_id chain, of a background chain, and of a
    Conversations API conversation each store only their own input beside the two segments before them, and read back
    the whole conversation they answered."""
    target, draft, _ = tiny_models
    gateway = ServerThread(tiny_backend(target, draft), http_port=0, sessions=open_session_store(redis_url))
    raw = store_beside(open_session_store(redis_url), 60.0, RESPONSE_PREFIX, 16)
    asked = {"model": "tiny-target", "max_output_tokens": 3, "temperature": 0, "extra_body": {"ignore_eos": True}}
    try:
        sdk = openai_sdk(gateway)
        conversation = sdk.conversations.create(items=[{"type": "message", "role": "user", "content": "Hello."}])
        ways = {"chain": {}, "background": {"background": True}, "conversation": {"conversation": conversation.id}}
        for way, options in ways.items():
            previous = None
            for turn in range(3):
                chained = {"previous_response_id": previous} if previous and way != "conversation" else {}
                response = sdk.responses.create(input=f"{way} {turn}", **asked, **options, **chained)
                while response.status in ("queued", "in_progress"):
                    time.sleep(0.05)
                    response = sdk.responses.retrieve(response.id)
                previous = response.id
            stored = raw.get(tenant_key("", previous))
            assert len(chain_ids(stored["chain"])) == 2, way
            own = raw.get(segment_key("", stored["segment"]))["items"]
            assert [item["content"][0]["text"] for item in own] == [f"{way} 2"], way
            answered = [item.model_dump(exclude_none=True)["id"] for item in
                        sdk.responses.input_items.list(previous, order="asc", limit=100)]
            assert len(answered) == (5 if way != "conversation" else 6), way  # (the conversation: "Hello." first)
        items = [item.id for item in sdk.conversations.items.list(conversation.id, order="asc", limit=100)]
        assert answered == items[:-1]  # the conversation before the third response's output
    finally:
        gateway.stop()
        raw.close()
