"""A tenant's records of one kind (uploaded files, batches) in the session store's backend, with an index to list them.

Each record lives under a digest of its tenant and id (gateway.openai.stored.tenant_key), beside stored responses:
in Redis when the gateway has one, so every replica reads, lists and changes what another wrote, else in memory;
each write renews its TTL (--response-ttl). A tenant's index of a kind is one more record, the ids oldest first,
changed atomically (SessionStore.update) so replicas adding at once each keep theirs; an id whose record expired is
dropped from the index the next time a listing meets it.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Callable

from tandem.gateway.openai.stored import store_key, tenant_key
from tandem.sessions import SessionStore

Change = Callable[[dict], object]  # changes a record in place


class TenantRecords:
    """Records of one kind (`kind`: "file", "batch"); the store's calls run off the event loop."""

    def __init__(self, store: SessionStore, kind: str, id_prefix: str) -> None:
        self._store = store
        self.kind = kind
        self._id_prefix = id_prefix
        self._ids = re.compile(re.escape(id_prefix) + "[0-9a-f]{32}")
        self._last_ms = 0

    def new_id(self) -> str:
        """A fresh id whose first 12 hex digits are its creation time in ms: ids sort as they were made, so that a
        listing can go on after one deleted since (order_key). Each later than the last made here, in the same ms
        too."""
        self._last_ms = max(int(time.time() * 1000), self._last_ms + 1)
        return f"{self._id_prefix}{self._last_ms:012x}{uuid.uuid4().hex[:20]}"

    def order_key(self, record_id: str) -> str | None:
        """What sorts `record_id` among this kind's ids by creation (None: not one of them)."""
        return record_id[len(self._id_prefix):] if self.is_id(record_id) else None

    def is_id(self, record_id: str) -> bool:
        """Whether `record_id` has the form of this kind's ids (new_id): an id a client sends must, so that it never
        names what is stored beside the records under ids of other forms (a file's content, a batch's results)."""
        return self._ids.fullmatch(record_id) is not None

    def _index_key(self, tenant: str) -> str:
        return store_key(tenant, f"\0{self.kind}-index")

    async def add(self, tenant: str, record_id: str, record: dict) -> None:
        """Store a new record and list it."""
        await self.put(tenant, record_id, record)
        await self._reindex(tenant, lambda ids: ids + [record_id])

    async def put(self, tenant: str, record_id: str, record: dict) -> None:
        """Store a record without listing it (what a listed one refers to: a file's content)."""
        await asyncio.to_thread(self._store.put, tenant_key(tenant, record_id), record)

    async def get(self, tenant: str, record_id: str) -> dict | None:
        record = await asyncio.to_thread(self._store.get, tenant_key(tenant, record_id))
        return record if isinstance(record, dict) else None

    async def update(self, tenant: str, record_id: str, change: Change) -> dict | None:
        """Change the record atomically (`change` may run more than once, on fresh reads); None when there is none.
        What `change` raises leaves it as it was."""
        def changed(record: dict | None) -> dict | None:
            if record is not None:
                change(record)
            return record

        return await asyncio.to_thread(self._store.update, tenant_key(tenant, record_id), changed)

    async def delete(self, tenant: str, record_id: str) -> bool:
        """Delete a record (and unlist it); True when there was one."""
        if await self.get(tenant, record_id) is None:
            return False
        await asyncio.to_thread(self._store.delete, tenant_key(tenant, record_id))
        await self._reindex(tenant, lambda ids: [other for other in ids if other != record_id])
        return True

    async def discard(self, tenant: str, record_id: str) -> None:
        """Delete a record that is not listed (one `put` stored), without reading it or touching the index."""
        await asyncio.to_thread(self._store.delete, tenant_key(tenant, record_id))

    async def all(self, tenant: str) -> list[dict]:
        """The tenant's listed records, oldest first."""
        def read() -> tuple[list[str], list[dict | None]]:
            index = self._store.get(self._index_key(tenant))
            ids = index["ids"] if isinstance(index, dict) else []
            return ids, [self._store.get(tenant_key(tenant, record_id)) for record_id in ids]

        ids, records = await asyncio.to_thread(read)
        if gone := {record_id for record_id, record in zip(ids, records, strict=True) if record is None}:
            await self._reindex(tenant, lambda kept: [other for other in kept if other not in gone])
        return [record for record in records if record is not None]

    async def get_shared(self, name: str) -> dict | None:
        """A record of this kind that belongs to no tenant (what every replica looks at: the batches running)."""
        record = await asyncio.to_thread(self._store.get, store_key("\0shared", f"{self.kind}-{name}"))
        return record if isinstance(record, dict) else None

    async def update_shared(self, name: str, change: Callable[[dict | None], dict | None]) -> None:
        await asyncio.to_thread(self._store.update, store_key("\0shared", f"{self.kind}-{name}"), change)

    async def _reindex(self, tenant: str, change: Callable[[list[str]], list[str]]) -> None:
        def changed(index: dict | None) -> dict | None:
            ids = change(index["ids"] if isinstance(index, dict) else [])
            return {"ids": ids} if ids else None

        await asyncio.to_thread(self._store.update, self._index_key(tenant), changed)

    def close(self) -> None:
        self._store.close()
