"""Riding out Redis outages: the outage half of RedisSessionStore (sessions.redis_store).

An outage is logged once and counted. Meanwhile calls are served from memory while one caller at a time probes Redis
with exponential backoff (a strict store asks Redis on every call), and the probe that finds it back writes the
sessions changed during the outage to Redis before the store counts as healthy again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import redis

from tandem.sessions.connection import redact_url
from tandem.sessions.store import MemorySessionStore, StoreCounters, StoreUnavailable

log = logging.getLogger(__name__)

_FLUSH_BATCH = 500
T = TypeVar("T")


class RedisOutages:
    """RedisSessionStore's outage methods; RedisSessionStore sets the state below and defines `_key`."""

    url: str
    strict: bool
    retry_initial_s: float
    retry_max_s: float
    counters: StoreCounters
    _memory: MemorySessionStore
    _client: redis.Redis
    _lock: threading.Lock
    _healthy: bool
    _backoff_s: float
    _next_try: float
    _dirty: set[str]

    def _mode(self) -> str | None:
        """'up'; 'probe' when Redis is down and due for a retry (claimed by this caller alone); None: use memory."""
        with self._lock:
            if self._healthy:
                return "up"
            if self.strict:  # nothing to serve from memory: every call asks Redis (and writes back once it answers)
                return "probe"
            now = time.monotonic()
            if now < self._next_try:
                return None
            self._next_try = now + self._backoff_s  # other callers keep using memory while this one probes
            return "probe"

    def _redis(self, op: Callable[[redis.Redis], T]) -> tuple[bool, T | None]:
        """(True, op's result), or (False, None) when Redis is down or failed (counted and logged)."""
        mode = self._mode()
        if mode is None:
            return False, None
        try:
            if mode == "probe":
                self._recover()
            return True, op(self._client)
        except redis.RedisError as error:
            self._failed(error, probe=mode == "probe")
            return False, None

    def _failed(self, error: Exception, probe: bool) -> None:
        with self._lock:
            self.counters.redis_errors += 1
            if self._healthy:
                self._healthy = False
                self.counters.outages += 1
                self._backoff_s = self.retry_initial_s
                self._next_try = time.monotonic() + self._backoff_s
                # A refused password (rotated under a running gateway) is said as such: retrying will not fix it.
                log.warning(
                    "Redis at %s %s (%s); serving session state from memory, retrying with backoff",
                    redact_url(self.url),
                    "refused the credentials" if isinstance(error, redis.AuthenticationError) else "unreachable",
                    error,
                )
            elif probe:
                self._backoff_s = min(2.0 * self._backoff_s, self.retry_max_s)
                self._next_try = time.monotonic() + self._backoff_s
                log.debug("Redis still unreachable (%s); next try in %.1f s", error, self._backoff_s)
            # else: another call of the same outage failed concurrently; counted only

    def _recover(self) -> None:
        """A probe: check Redis, write back what changed during the outage, and mark Redis healthy."""
        self._client.ping()
        written = 0
        while True:
            with self._lock:
                dirty, self._dirty = self._dirty, set()
                if not dirty:
                    self._healthy = True
                    self._backoff_s = self.retry_initial_s
                    self.counters.recoveries += 1
                    self.counters.written_back += written
                    break
            try:
                self._write_back(dirty)
            except redis.RedisError:
                with self._lock:
                    self._dirty |= dirty
                raise
            if self.strict:  # in Redis now, and a strict store serves nothing from memory
                for session_id in dirty:
                    self._memory.delete(session_id)
            written += len(dirty)
        log.warning("Redis at %s reachable again; %d session(s) written back", redact_url(self.url), written)

    def _write_back(self, session_ids: set[str]) -> None:
        ids = sorted(session_ids)
        for start in range(0, len(ids), _FLUSH_BATCH):
            pipe = self._client.pipeline(transaction=False)
            for session_id in ids[start : start + _FLUSH_BATCH]:
                item = self._memory.get_raw(session_id)
                if item is None:
                    pipe.delete(self._key(session_id))
                else:
                    pipe.set(self._key(session_id), item[0], px=max(1, int(item[1] * 1000)))
            pipe.execute()

    def _refuse_if_strict(self) -> None:
        if self.strict:
            raise StoreUnavailable(f"the shared store (Redis at {redact_url(self.url)}) is not answering; nothing was "
                                   "read or changed, retry")

    def _fallback(self, session_id: str | None = None) -> bool:
        """Count an operation served from memory; a write (`session_id`, already made in memory) is remembered for
        write-back. False for a write when Redis came back since this call chose memory (another caller's probe
        wrote back what was remembered until then): the caller writes it to Redis itself, or it would be in
        neither place (a session stored as Redis came back would be lost)."""
        with self._lock:
            self.counters.fallbacks += 1
            if session_id is None:
                return True
            if not self._healthy:
                self._dirty.add(session_id)
                return True
            return False
