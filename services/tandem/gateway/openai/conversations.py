"""Conversations (OpenAI's Conversations API): a stored list of items that responses created with `conversation`
read as their history and extend with their input and output once they finish.

A conversation is one record (its object and its items) in the session store's backend under its own key prefix,
beside the stored responses: Redis when the gateway has one (every replica reads and extends it; each write renews
its TTL, --response-ttl), else memory. The key is a digest of the tenant and the id, as for stored responses. A change
(items added or deleted, metadata) is a read-modify-write the store makes atomic (in Redis an optimistic transaction),
so replicas changing one conversation at once each keep their change.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

from tandem.gateway.openai.errors import OpenAIError
from tandem.gateway.openai.responses_input import check_unique_ids
from tandem.gateway.openai.stored import store_beside, tenant_key
from tandem.sessions import SessionStore

CONVERSATION_PREFIX = "tandem:conversation:"
MAX_IN_MEMORY = 2048
MAX_NEW_ITEMS = 20  # OpenAI's limit on the items one create call adds


def not_found(conversation_id: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(404, f"Conversation with id '{conversation_id}' not found.", param=param)


class ConversationStore:
    """Conversations over a key-value store with a TTL (a session store); its calls run off the event loop."""

    def __init__(self, store: SessionStore) -> None:
        self._store = store

    async def create(self, tenant: str, items: list[dict], metadata: dict[str, str]) -> dict:
        check_unique_ids(items, "items")
        conversation = {"id": f"conv_{uuid.uuid4().hex}", "object": "conversation", "created_at": int(time.time()),
                        "metadata": metadata}
        await self._put(tenant, {"conversation": conversation, "items": items})
        return conversation

    async def _put(self, tenant: str, record: dict) -> None:
        await asyncio.to_thread(self._store.put, tenant_key(tenant, record["conversation"]["id"]), record)

    async def get(self, tenant: str, conversation_id: str, param: str | None = None) -> dict:
        """The record ({"conversation", "items"}); a 404 (naming `param`) without it."""
        return _found(await asyncio.to_thread(self._store.get, tenant_key(tenant, conversation_id)), conversation_id,
                      param)

    async def update(self, tenant: str, conversation_id: str, change: Callable[[dict], object]) -> dict:
        """Apply `change` to the record (in place; it may run more than once, each time on a fresh read) and store
        it atomically; the record after. What `change` raises leaves the record as it was."""
        def changed(record: dict | None) -> dict:
            change(record := _found(record, conversation_id))
            return record

        return await asyncio.to_thread(self._store.update, tenant_key(tenant, conversation_id), changed)

    async def extend(self, tenant: str, conversation_id: str, items: list[dict], response_id: str | None = None
                     ) -> dict:
        """Add the items (a response's input and output; `response_id`: that response, where it is stored: the next
        response in the conversation is stored as what it adds to that one's, gateway.openai.stored_chain)."""
        def extended(record: dict) -> None:
            check_unique_ids(record["items"] + items, "items")
            record["items"].extend(items)
            if response_id is not None:
                record["last_response"] = response_id

        return await self.update(tenant, conversation_id, extended)

    async def delete(self, tenant: str, conversation_id: str) -> None:
        await self.get(tenant, conversation_id)  # a 404 where there is none
        await asyncio.to_thread(self._store.delete, tenant_key(tenant, conversation_id))

    def close(self) -> None:
        self._store.close()


def _found(record: object, conversation_id: str, param: str | None = None) -> dict:
    if not isinstance(record, dict) or "conversation" not in record or "items" not in record:
        raise not_found(conversation_id, param)
    return record


def open_conversation_store(sessions: object, ttl_s: float) -> ConversationStore | None:
    """Conversations beside `sessions` (in its Redis when it is one); None when ttl_s is 0."""
    return ConversationStore(store_beside(sessions, ttl_s, CONVERSATION_PREFIX, MAX_IN_MEMORY)) if ttl_s > 0 else None
