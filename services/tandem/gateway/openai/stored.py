"""Stored responses (the Responses API's `store`): kept per tenant so that a later request can continue one
(`previous_response_id`), read it back (GET /v1/responses/{id} and its input_items) or delete it.

A stored response is the response object and the conversation it answered: the items of every earlier turn, then
its own input. Continuing it is that conversation, its output, then the new input; the earlier `instructions` are not
carried over (OpenAI's rule: each request gives its own). Records live in the gateway's session store backend under
their own key prefix: Redis when the gateway has one (every gateway replica reads what another stored; a TTL bounds
them), else process memory (LRU-bounded). The key is a digest of the tenant and the id, so an API key never reaches
another's responses, whatever id it sends.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass

from tandem.gateway.openai.errors import OpenAIError
from tandem.sessions import MemorySessionStore, RedisSessionStore, SessionStore

RESPONSE_PREFIX = "tandem:response:"
# Responses held in this process (all of them without Redis, a write-through copy with it); the oldest-used go first.
MAX_IN_MEMORY = 2048
# How long a shared record's read or change waits for Redis before it is a 503: longer than the session store's 0.3 s,
# after which a session's state is served from memory; a record has no such fallback, and a loaded Redis (or a
# gateway whose threads wait for CPU) answers a round trip in more than 0.3 s now and then.
STRICT_TIMEOUT_S = 2.0


@dataclass(slots=True, frozen=True)
class StoredResponse:
    response: dict  # the response object as GET returns it
    items: list[dict]  # the conversation it answered: earlier turns' items, then its own input, each with an id

    def conversation(self) -> list[dict]:
        """The items a response continuing this one starts from: its conversation, then its output."""
        return self.items + self.response["output"]


class _Taken(Exception):
    pass


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
    """Stored responses over a key-value store with a TTL (a session store); its calls run off the event loop."""

    def __init__(self, store: SessionStore) -> None:
        self._store = store

    @property
    def ttl_s(self) -> float:
        """How long a response lives after it was last stored."""
        return self._store.ttl_s

    async def put(self, tenant: str, stored: StoredResponse) -> None:
        record = {"response": stored.response, "items": stored.items}
        await asyncio.to_thread(self._store.put, tenant_key(tenant, stored.response["id"]), record)

    async def create(self, tenant: str, stored: StoredResponse) -> None:
        """put, where no response of the tenant has that id yet (atomically, across replicas); else id_in_use."""
        record = {"response": stored.response, "items": stored.items}

        def change(state: dict | None) -> dict:
            if state is not None:
                raise _Taken
            return record

        try:
            await asyncio.to_thread(self._store.update, tenant_key(tenant, stored.response["id"]), change)
        except _Taken:
            raise id_in_use(stored.response["id"]) from None

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        record = await asyncio.to_thread(self._store.get, tenant_key(tenant, response_id))
        if not isinstance(record, dict) or "response" not in record or "items" not in record:
            return None
        return StoredResponse(record["response"], record["items"])

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
        if await self.get(tenant, response_id) is None:
            return False
        await asyncio.to_thread(self._store.delete, tenant_key(tenant, response_id))
        return True

    def close(self) -> None:
        self._store.close()


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

