"""Conversations (OpenAI's Conversations API): a stored list of items that responses created with `conversation`
read as their history and extend with their input and output once they finish.

A conversation is one record (its object and its items) in the session store's backend under its own key prefix,
beside the stored responses: Redis when the gateway has one (every replica reads and extends it; each write renews
its TTL, --response-ttl), else memory. The key is a digest of the tenant and the id, as for stored responses. Writes
to one conversation are serialized within a replica; two replicas extending the same conversation at the same instant
may lose one write (the last one stands): a conversation is meant to be driven by one client at a time.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
import weakref
from collections.abc import Callable

from tandem.gateway.openai.errors import OpenAIError, bad_request
from tandem.gateway.openai.stored import store_beside
from tandem.sessions import SessionStore

CONVERSATION_PREFIX = "tandem:conversation:"
MAX_IN_MEMORY = 2048
MAX_NEW_ITEMS = 20  # OpenAI's limit on the items one create call adds
MAX_METADATA = 16  # key-value pairs, keys up to 64 characters, values up to 512


def check_metadata(metadata: object) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in metadata.items()):
        raise bad_request(f"metadata: at most {MAX_METADATA} pairs of strings, keys up to 64 characters and values up "
                          "to 512", "metadata")
    return dict(metadata)


def not_found(conversation_id: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(404, f"Conversation with id '{conversation_id}' not found.", param=param)


class ConversationStore:
    """Conversations over a key-value store with a TTL (a session store); its calls run off the event loop."""

    def __init__(self, store: SessionStore) -> None:
        self._store = store
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    @staticmethod
    def _key(tenant: str, conversation_id: str) -> str:
        return hashlib.sha256(f"{tenant}\0{conversation_id}".encode()).hexdigest()

    async def create(self, tenant: str, items: list[dict], metadata: dict[str, str]) -> dict:
        conversation = {"id": f"conv_{uuid.uuid4().hex}", "object": "conversation", "created_at": int(time.time()),
                        "metadata": metadata}
        await self._put(tenant, {"conversation": conversation, "items": items})
        return conversation

    async def _put(self, tenant: str, record: dict) -> None:
        await asyncio.to_thread(self._store.put, self._key(tenant, record["conversation"]["id"]), record)

    async def get(self, tenant: str, conversation_id: str, param: str | None = None) -> dict:
        """The record ({"conversation", "items"}); a 404 (naming `param`) without it."""
        record = await asyncio.to_thread(self._store.get, self._key(tenant, conversation_id))
        if not isinstance(record, dict) or "conversation" not in record or "items" not in record:
            raise not_found(conversation_id, param)
        return record

    async def update(self, tenant: str, conversation_id: str, change: Callable[[dict], object]) -> dict:
        """Apply `change` to the record (in place) and store it, one writer at a time here; the record after."""
        key = self._key(tenant, conversation_id)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            record = await self.get(tenant, conversation_id)
            change(record)
            await self._put(tenant, record)
            return record

    async def extend(self, tenant: str, conversation_id: str, items: list[dict]) -> dict:
        return await self.update(tenant, conversation_id, lambda record: record["items"].extend(items))

    async def delete(self, tenant: str, conversation_id: str) -> None:
        await self.get(tenant, conversation_id)  # a 404 where there is none
        await asyncio.to_thread(self._store.delete, self._key(tenant, conversation_id))

    def close(self) -> None:
        self._store.close()


def open_conversation_store(sessions: object, ttl_s: float) -> ConversationStore | None:
    """Conversations beside `sessions` (in its Redis when it is one); None when ttl_s is 0."""
    return ConversationStore(store_beside(sessions, ttl_s, CONVERSATION_PREFIX, MAX_IN_MEMORY)) if ttl_s > 0 else None
