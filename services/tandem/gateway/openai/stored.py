"""Stored responses (the Responses API's `store`): kept per tenant so that a later request can continue one
(`previous_response_id`), read it back (GET /v1/responses/{id} and its input_items) or delete it.

A stored response is the response object and the conversation it answered: the items of every earlier turn, then its
own input (kept as what it added to the responses before it: gateway.openai.stored_chain). Continuing it is that
conversation, its output, then the new input; the earlier `instructions` are not carried over (OpenAI's rule: each
request gives its own). Records live in the gateway's session store backend under their own key prefix: Redis when
the gateway has one (every gateway replica reads what another stored; a TTL bounds them), else process memory
(LRU-bounded). The key is a digest of the tenant and the id, so an API key never reaches another's responses,
whatever id it sends.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, replace

from tandem.gateway.openai.errors import OpenAIError
from tandem.gateway.openai.stored_chain import Segment, chain_ids, chain_text, conversation_of, new_segment_id, split
from tandem.sessions import MemorySessionStore, RedisSessionStore, SessionStore

RESPONSE_PREFIX = "tandem:response:"
# Records held in this process without Redis (with it, those waiting for its return), two a response (its head and its
# segment: stored_chain); the oldest-used go first, and a chain whose first segments went can no longer be continued.
MAX_IN_MEMORY = 4096
# How long a shared record's read or change waits for Redis before it is a 503: longer than the session store's 0.3 s,
# after which a session's state is served from memory; a record has no such fallback, and a loaded Redis (or a
# gateway whose threads wait for CPU) answers a round trip in more than 0.3 s now and then.
STRICT_TIMEOUT_S = 2.0


@dataclass(slots=True, frozen=True)
class StoredResponse:
    response: dict  # the response object as GET returns it
    # The conversation it answered: earlier turns' items, then its own input, each with an id. None where a response
    # before it in its chain is no longer stored (gone from a full store), so the conversation cannot be rebuilt.
    items: list[dict] | None
    after: str | None = None  # the response whose conversation and output `items` likely begin with (ResponsesTurn)

    def conversation(self) -> list[dict]:
        """The items a response continuing this one starts from: its conversation, then its output."""
        if self.items is None:
            raise chain_broken(self.response["id"], "previous_response_id")
        return self.items + self.response["output"]


class _Taken(Exception):
    pass


class _Absent(Exception):
    pass


def chain_broken(response_id: str, param: str | None = None) -> OpenAIError:
    """A 404 for a stored response whose conversation cannot be rebuilt: a response before it is gone (expired, or
    dropped from a full store)."""
    return OpenAIError(404, f"The conversation of response '{response_id}' is no longer stored whole: an earlier "
                            "response of it is gone.", param=param, code="previous_response_not_found")


def id_in_use(response_id: str) -> OpenAIError:
    """A client's request_id that names a stored response: ids name one response each, so it is not overwritten (a
    400, not a 409, which the SDKs would retry in vain)."""
    return OpenAIError(400, f"request_id: a response with id {response_id!r} exists; send another id, or none",
                       param="request_id", code="response_id_in_use")


def tenant_key(tenant: str, record_id: str) -> str:
    """The store key of a tenant's record (a response, a conversation, a file) by a client's id: another tenant
    sending the same id finds nothing. A client's ids are printable; one that is not (a URL's %00, JSON's \\u0000)
    names nothing, a 404: the store's own records are named with a NUL (store_key), out of a client's reach."""
    if not record_id.isprintable():
        raise OpenAIError(404, f"No object with id {record_id!r} exists.", code="not_found")
    return store_key(tenant, record_id)


def store_key(tenant: str, name: str) -> str:
    """The store key of `name` under `tenant`: tenant_key for the gateway's own names (a tenant's index of its files,
    what every replica shares), which hold a NUL."""
    return hashlib.sha256(f"{tenant}\0{name}".encode()).hexdigest()


class ResponseStore:
    """Stored responses over a key-value store with a TTL (a session store); its calls run off the event loop.

    A response is a head and a segment (stored_chain): the head, the response as GET returns it less its output, lives
    --response-ttl past its last store; the segment, its output and what it added to the conversation, as long as
    that or a later response's store (storing a response starts its chain's segments' TTLs again). A segment that a
    later response reads is marked `continued`: deleting its response then keeps it for that one."""

    def __init__(self, store: SessionStore) -> None:
        self._store = store

    @property
    def ttl_s(self) -> float:
        """How long a response lives after it was last stored."""
        return self._store.ttl_s

    async def put(self, tenant: str, stored: StoredResponse) -> None:
        await asyncio.to_thread(self._put, tenant, stored, False)

    async def create(self, tenant: str, stored: StoredResponse) -> None:
        """put, where no response of the tenant has that id yet (atomically, across replicas); else id_in_use."""
        try:
            await asyncio.to_thread(self._put, tenant, stored, True)
        except _Taken:
            raise id_in_use(stored.response["id"]) from None

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        return await asyncio.to_thread(self._get, tenant, response_id)

    async def history(self, tenant: str, previous: str) -> list[dict]:
        """The items a response continuing `previous` starts from; a 404 naming previous_response_id without it."""
        found = await self.get(tenant, previous)
        if found is None:
            raise OpenAIError(404, f"Previous response with id '{previous}' not found.", param="previous_response_id",
                              code="previous_response_not_found")
        # Still running (a background response, or a synchronous one holding its id): its output is not there yet.
        if found.response.get("status") in ("queued", "in_progress"):
            raise OpenAIError(400, f"Previous response with id '{previous}' is still {found.response['status']}; "
                                   "continue it once it has completed.", param="previous_response_id")
        return found.conversation()

    async def delete(self, tenant: str, response_id: str) -> bool:
        """True when there was such a response."""
        return await asyncio.to_thread(self._delete, tenant, response_id)

    def close(self) -> None:
        self._store.close()

    def _get(self, tenant: str, response_id: str) -> StoredResponse | None:
        head = self._store.get(tenant_key(tenant, response_id))
        if not isinstance(head, dict) or "response" not in head:
            return None
        if "segment" not in head:  # stored whole, before segments
            return StoredResponse(head["response"], head["items"]) if "items" in head else None
        *chain, own = self._segments(tenant, chain_ids(head["chain"]) + [head["segment"]])
        if own is None:  # (its segment gone from a full store: not found, as where its head went first)
            return None
        items = None if None in chain else own.answered(conversation_of(chain))
        return StoredResponse({**head["response"], "output": own.output}, items)

    def _segments(self, tenant: str, segment_ids: list[str]) -> list[Segment | None]:
        """The segments, in one round trip (None for one gone)."""
        return [Segment.of(record) for record in self._store.get_many([segment_key(tenant, segment_id)
                                                                       for segment_id in segment_ids])]

    def _put(self, tenant: str, stored: StoredResponse, new: bool) -> None:
        key = tenant_key(tenant, stored.response["id"])
        held = None if new else self._store.get(key)
        kept = Segment.of(self._store.get(segment_key(tenant, held["segment"]))) if (
            isinstance(held, dict) and "segment" in held) else None
        if kept is not None:  # stored before (a response's conversation never changes), its output changed
            segment_id, chain, segment = held["segment"], chain_ids(held["chain"]), kept
        elif stored.items is None:  # read while its chain was broken, and gone since: nothing to store it from
            return
        else:
            segment_id = new_segment_id()
            chain, segment = self._link(tenant, stored.after, stored.items)
        own_key = segment_key(tenant, segment_id)
        fields = replace(segment, output=stored.response["output"]).fields()
        if kept is None:  # a new id: no later response has read it
            self._store.put(own_key, fields)
        else:
            self._store.update(own_key, lambda old: {**fields, "continued": bool(old and old.get("continued"))},
                               shorten_ttl=False)
        head = {"response": {**stored.response, "output": []}, "segment": segment_id, "chain": chain_text(chain)}
        if new:
            self._claim(key, head, own_key)
        else:
            self._store.put(key, head)
        self._store.renew([segment_key(tenant, earlier) for earlier in chain])

    def _claim(self, key: str, head: dict, own_key: str) -> None:
        """Store a head where none is (atomically, across replicas); else _Taken, its new segment dropped."""
        def claim(record: dict | None) -> dict:
            if record is not None:
                raise _Taken
            return head

        try:
            self._store.update(key, claim)
        except _Taken:
            self._store.delete(own_key)
            raise

    def _link(self, tenant: str, previous: str | None, items: list[dict]) -> tuple[list[str], Segment]:
        """The chain and segment (its output left empty) of a response answering `items` after `previous`: linked to
        it where its chain is whole, else with its items whole. Its predecessor's segment is marked continued first,
        so that a delete from then on keeps it."""
        def mark(record: dict | None) -> dict:
            if Segment.of(record) is None:
                raise _Absent
            return {**record, "continued": True}

        whole = [], Segment(0, items, [])
        head = self._store.get(tenant_key(tenant, previous)) if previous is not None else None
        if not isinstance(head, dict) or "segment" not in head:
            return whole
        try:
            last = Segment.of(self._store.update(segment_key(tenant, head["segment"]), mark, shorten_ttl=False))
        except _Absent:
            return whole
        chain = chain_ids(head["chain"])
        segments = self._segments(tenant, chain)
        if None in segments:
            return whole
        skip, own = split(conversation_of([*segments, last]), items)
        return [*chain, head["segment"]], Segment(skip, own, [])

    def _delete(self, tenant: str, response_id: str) -> bool:
        heads = []

        def remove(head: dict | None) -> None:
            if not isinstance(head, dict) or "response" not in head:
                raise _Absent
            heads.append(head)

        try:
            self._store.update(tenant_key(tenant, response_id), remove)
        except _Absent:
            return False
        if "segment" in heads[-1]:  # kept where a later response reads it (marked so before it read it)
            self._store.update(segment_key(tenant, heads[-1]["segment"]),
                               lambda segment: segment if segment is not None and segment.get("continued") else None)
        return True


def segment_key(tenant: str, segment_id: str) -> str:
    """The store key of a response's segment (stored_chain): a NUL in its name, out of a client's ids' reach."""
    return store_key(tenant, f"\0response-segment-{segment_id}")


def store_beside(sessions: object, ttl_s: float, prefix: str, max_in_memory: int) -> SessionStore:
    """A key-value store with a TTL beside `sessions`: the same Redis under `prefix` when it is one (strict: a record
    every replica may change is not changed in one replica's memory while Redis is away), else memory."""
    if isinstance(sessions, RedisSessionStore):
        return RedisSessionStore(sessions.url, ttl_s, prefix=prefix, max_sessions=max_in_memory, strict=True,
                                 socket_timeout_s=STRICT_TIMEOUT_S)
    return MemorySessionStore(ttl_s, max_in_memory)


def open_response_store(sessions: object, ttl_s: float) -> ResponseStore | None:
    """Stored responses beside `sessions`; None when ttl_s is 0 (nothing stored: `store` is answered false and
    previous_response_id refused)."""
    return ResponseStore(store_beside(sessions, ttl_s, RESPONSE_PREFIX, MAX_IN_MEMORY)) if ttl_s > 0 else None

