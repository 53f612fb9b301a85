"""The event logs of background responses: every streamed event of one, kept so that a client can read (or read
again, after a dropped connection) its stream from any sequence number, and the flag that asks it to stop.

A background response runs on the gateway replica that took it; its events and its cancel flag go where every replica
can reach them: a Redis stream per response (XADD by the runner, XREAD BLOCK by each reader) and a key, in the Redis
the stored responses use; else process memory, where only this replica runs and reads them. An end mark closes a log:
readers stop there. Logs expire with the stored responses (the same TTL).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Protocol

import redis.asyncio

from tandem.sessions import RedisSessionStore

log = logging.getLogger(__name__)

EVENTS_PREFIX = "tandem:response-events:"
CANCEL_PREFIX = "tandem:response-cancel:"
LEASE_PREFIX = "tandem:response-lease:"  # held by the replica running a response while it runs
ENDER_PREFIX = "tandem:response-ender:"  # taken by the one replica that ends a response whose runner died
MAX_ENDED_IN_MEMORY = 256  # ended logs held in this process without Redis; the oldest go first
READ_BLOCK_MS = 1000  # a Redis reader's wait for new events before it looks again
# A replica's Redis connections: for writes, leases and cancel flags (each call holds one for a round trip), and for
# readers (each holds one for up to READ_BLOCK_MS). A call waits up to POOL_WAIT_S for one to be free rather than raise:
# a runner whose lease could not be taken would be taken for dead and its response failed.
CONTROL_CONNECTIONS, READER_CONNECTIONS, POOL_WAIT_S = 32, 512, 10.0
READ_RETRIES = 50  # a reader's Redis errors in a row (0.2 s apart) before its stream ends with one


class ResponseLog(Protocol):
    async def append(self, key: str, events: list[dict]) -> None: ...
    async def end(self, key: str) -> None: ...
    def read(self, key: str, after: int) -> AsyncGenerator[dict, None]: ...
    async def logged(self, key: str) -> list[dict]: ...
    async def claim_end(self, key: str) -> bool: ...
    async def request_cancel(self, key: str) -> None: ...
    async def cancel_requested(self, key: str) -> bool: ...
    async def renew_lease(self, key: str, seconds: float, new: bool = False) -> bool: ...
    async def lease_held(self, key: str) -> bool: ...
    async def close(self) -> None: ...


@dataclass(slots=True)
class _Events:
    expires: float
    events: list[dict] = field(default_factory=list)
    ended: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def wake(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class MemoryResponseLog:
    """Logs in this process (one gateway replica: it runs every background response it is asked about)."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._logs: OrderedDict[str, _Events] = OrderedDict()
        self._cancelled: set[str] = set()

    def _log(self, key: str) -> _Events:
        if (entry := self._logs.get(key)) is not None:
            return entry
        now = time.monotonic()  # a new log: the expired ones go (not on every append: it runs once a token)
        for old in [old for old, events in self._logs.items() if events.ended and events.expires < now]:
            del self._logs[old]
        entry = self._logs[key] = _Events(now + self.ttl_s)
        return entry

    async def append(self, key: str, events: list[dict]) -> None:
        entry = self._log(key)
        entry.events += events
        entry.wake()

    async def end(self, key: str) -> None:
        entry = self._log(key)
        entry.ended = True
        entry.expires = time.monotonic() + self.ttl_s  # (as its stored response, kept once more as it ended)
        entry.wake()
        self._cancelled.discard(key)
        self._logs.move_to_end(key)
        ended = [old for old, events in self._logs.items() if events.ended]
        for old in ended[:max(0, len(ended) - MAX_ENDED_IN_MEMORY)]:
            del self._logs[old]

    async def read(self, key: str, after: int) -> AsyncGenerator[dict, None]:
        """The events with a sequence number above `after`, as they come, until the end mark (none if no log)."""
        entry = self._logs.get(key)
        if entry is None:
            return
        sent = 0
        while True:
            changed = entry.changed
            for event in entry.events[sent:]:
                if event["sequence_number"] > after:
                    yield event
            sent = len(entry.events)
            if entry.ended:
                return
            await changed.wait()

    async def logged(self, key: str) -> list[dict]:
        """Every event of the log so far."""
        entry = self._logs.get(key)
        return [] if entry is None else list(entry.events)

    async def claim_end(self, key: str) -> bool:
        return True  # one process: its runner is the only one that ends it

    async def request_cancel(self, key: str) -> None:
        self._cancelled.add(key)

    async def cancel_requested(self, key: str) -> bool:
        return key in self._cancelled

    async def renew_lease(self, key: str, seconds: float, new: bool = False) -> bool:
        return True  # one process: a runner that died took every reader with it

    async def lease_held(self, key: str) -> bool:
        return True

    async def close(self) -> None:
        self._logs.clear()


class RedisResponseLog:
    """Logs in Redis (every gateway replica reads what another runs): a stream of JSON events and an end mark.

    An append does not wait for Redis: one writer task per log sends what has piled up since its last round trip in
    one pipeline, so the runner never waits a round trip per token and a busy log costs fewer of them."""

    def __init__(self, url: str, ttl_s: float) -> None:
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self._client = _client(url, CONTROL_CONNECTIONS)
        self._readers = _client(url, READER_CONNECTIONS)
        self._untaken: set[str] = set()  # leases a runner could not take (Redis failed): taken at the next beat
        self._pending: dict[str, list[dict[str, str]]] = {}
        self._writers: dict[str, asyncio.Task] = {}
        self.round_trips = 0
        self._failures = 0

    def _queue(self, key: str, entries: list[dict[str, str]]) -> asyncio.Task:
        self._pending.setdefault(key, []).extend(entries)
        if key not in self._writers:
            self._writers[key] = asyncio.create_task(self._write(key))
        return self._writers[key]

    async def _write(self, key: str) -> None:
        try:
            while entries := self._pending.pop(key, None):  # (no await between the last pop and the finally)
                await self._send(key, entries)
        finally:
            del self._writers[key]

    async def _send(self, key: str, entries: list[dict[str, str]]) -> None:
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                for entry in entries:
                    pipe.xadd(EVENTS_PREFIX + key, entry)
                pipe.pexpire(EVENTS_PREFIX + key, self.ttl_ms)
                await pipe.execute()
            self.round_trips += 1
        except redis.RedisError as error:  # the response itself is still stored: only its replay is short
            self._failures += 1
            if self._failures == 1 or self._failures % 100 == 0:
                log.warning("background response events not written to Redis (%d so far): %s", self._failures, error)

    async def append(self, key: str, events: list[dict]) -> None:
        if events:
            self._queue(key, [{"e": json.dumps(event, ensure_ascii=False, separators=(",", ":"))}
                              for event in events])

    async def end(self, key: str) -> None:
        """Written once every event before it is: a reader that meets it has seen them all."""
        self._untaken.discard(key)
        await asyncio.shield(self._queue(key, [{"end": "1"}]))

    async def read(self, key: str, after: int) -> AsyncGenerator[dict, None]:
        last, failures = "0-0", 0
        while True:
            try:
                found = await self._readers.xread({EVENTS_PREFIX + key: last}, count=512, block=READ_BLOCK_MS)
                if not found and not await self._readers.exists(EVENTS_PREFIX + key):
                    return  # expired or never written
                failures = 0
            except redis.RedisError:
                failures += 1
                if failures >= READ_RETRIES:
                    raise
                await asyncio.sleep(0.2)
                continue
            if not found:
                if not await self.lease_held(key):
                    return  # no replica runs it any more (no end mark is coming)
                continue
            for entry_id, fields in found[0][1]:
                last = entry_id
                if "end" in fields:
                    return
                event = json.loads(fields["e"])
                if event["sequence_number"] > after:
                    yield event

    async def logged(self, key: str) -> list[dict]:
        events = []
        for _, fields in await self._client.xrange(EVENTS_PREFIX + key):
            if "end" in fields:
                break
            events.append(json.loads(fields["e"]))
        return events

    async def claim_end(self, key: str) -> bool:
        """True for the one caller that is to end a response whose runner is gone (replicas that find it so at once
        would each write its last events)."""
        return bool(await self._client.set(ENDER_PREFIX + key, "1", px=self.ttl_ms, nx=True))

    async def request_cancel(self, key: str) -> None:
        await self._client.set(CANCEL_PREFIX + key, "1", px=self.ttl_ms)

    async def cancel_requested(self, key: str) -> bool:
        try:
            return bool(await self._client.exists(CANCEL_PREFIX + key))
        except redis.RedisError:
            return False  # asked again at the next look

    async def renew_lease(self, key: str, seconds: float, new: bool = False) -> bool:
        """Take (`new`) or renew the lease: False when it had run out (another replica may have ended the response)."""
        new = new or key in self._untaken
        try:
            held = bool(await self._client.set(LEASE_PREFIX + key, "1", px=max(1, int(seconds * 1000)), xx=not new))
        except redis.RedisError:
            if new:
                self._untaken.add(key)
            return True  # retried at the next beat; a lease lost to an outage longer than it reads as a dead runner
        self._untaken.discard(key)
        return held

    async def lease_held(self, key: str) -> bool:
        try:
            return bool(await self._client.exists(LEASE_PREFIX + key))
        except redis.RedisError:
            return True  # unknown: not declared dead on an outage

    async def close(self) -> None:
        await asyncio.gather(*self._writers.values(), return_exceptions=True)
        await self._client.aclose()
        await self._readers.aclose()


def _client(url: str, connections: int) -> redis.asyncio.Redis:
    """A client over a pool of `connections` that a call waits for (POOL_WAIT_S) when all are in use. Readers block
    up to READ_BLOCK_MS on XREAD: the socket timeout is well past it."""
    pool = redis.asyncio.BlockingConnectionPool.from_url(url, max_connections=connections, timeout=POOL_WAIT_S,
                                                         decode_responses=True, socket_timeout=READ_BLOCK_MS / 200,
                                                         socket_connect_timeout=1.0)
    return redis.asyncio.Redis.from_pool(pool)


def open_response_log(sessions: object, ttl_s: float) -> ResponseLog:
    """Background responses' logs beside the stored responses: in the sessions' Redis when they have one."""
    if isinstance(sessions, RedisSessionStore):
        return RedisResponseLog(sessions.url, ttl_s)
    return MemoryResponseLog(ttl_s)
