"""Per-session state stores: what every store offers (SessionStore), and the one in this process's memory.

A session's state is a small JSON-able dict (the policy's `PolicyState.to_dict()` plus worker affinity). In memory it
lives as long as this process; sessions.redis_store shares it through Redis.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Protocol

DEFAULT_TTL_S = 3600.0
# Sessions kept in the in-memory copy; the oldest-used go first (Redis still has them when it is up).
DEFAULT_MAX_SESSIONS = 100_000
Change = Callable[[dict | None], dict | None]  # a state (None: none) -> the state to store (None: delete)


class UpdateConflict(RuntimeError):
    """Other writers changed a key on every try of an update (sessions.redis_store MAX_UPDATE_TRIES)."""


class StoreUnavailable(RuntimeError):
    """A strict store's read or update could not reach Redis (RedisSessionStore `strict`)."""


@dataclass(slots=True)
class StoreCounters:
    redis_errors: int = 0  # Redis calls that failed
    fallbacks: int = 0  # operations served from memory because Redis was down
    recoveries: int = 0  # outages that ended (Redis answered again)
    outages: int = 0  # outages that began
    written_back: int = 0  # sessions changed during an outage and written to Redis on recovery


class SessionStore(Protocol):
    ttl_s: float  # how long an entry lives after its last write

    def get(self, session_id: str) -> dict | None: ...
    def get_many(self, session_ids: list[str]) -> list[dict | None]: ...
    def put(self, session_id: str, state: dict) -> None: ...
    def renew(self, session_ids: list[str]) -> None: ...
    def update(self, session_id: str, change: Change, *, shorten_ttl: bool = True) -> dict | None: ...
    def delete(self, session_id: str) -> None: ...
    def stats(self) -> dict: ...
    def close(self) -> None: ...

    @property
    def healthy(self) -> bool: ...


class MemorySessionStore:
    """Process-local sessions with a TTL (refreshed on put) and an LRU bound; thread-safe."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_sessions: int = DEFAULT_MAX_SESSIONS) -> None:
        self.ttl_s = float(ttl_s)
        self.max_sessions = max_sessions
        self.counters = StoreCounters()
        self._items: OrderedDict[str, tuple[float, str]] = OrderedDict()  # id -> (expiry, JSON)
        self._lock = threading.Lock()

    @property
    def healthy(self) -> bool:
        return True

    def get(self, session_id: str) -> dict | None:
        with self._lock:
            item = self._items.get(session_id)
            if item is None:
                return None
            if item[0] <= time.monotonic():
                del self._items[session_id]
                return None
            self._items.move_to_end(session_id)
            return json.loads(item[1])

    def get_many(self, session_ids: list[str]) -> list[dict | None]:
        return [self.get(session_id) for session_id in session_ids]

    def put(self, session_id: str, state: dict) -> None:
        self.put_raw(session_id, json.dumps(state, separators=(",", ":")))

    def put_raw(self, session_id: str, value: str, ttl_s: float | None = None) -> None:
        expiry = time.monotonic() + (self.ttl_s if ttl_s is None else ttl_s)
        with self._lock:
            self._items[session_id] = (expiry, value)
            self._items.move_to_end(session_id)
            while len(self._items) > self.max_sessions:
                self._items.popitem(last=False)

    def update(self, session_id: str, change: Change, *, shorten_ttl: bool = True) -> dict | None:
        """Read, change and write one state atomically (no other put or update between): `change` gets the state
        (None: none) and returns the one to store (None: delete it); what it raises leaves the state as it was.
        Returns the state stored. Its TTL starts again; with shorten_ttl False, only where that lengthens it (a
        change that is no store of the state, made by a replica whose TTL may be shorter)."""
        with self._lock:
            item = self._items.get(session_id)
            state = None if item is None or item[0] <= time.monotonic() else json.loads(item[1])
            changed = change(state)
            if changed is None:
                self._items.pop(session_id, None)
                return None
            expiry = time.monotonic() + self.ttl_s
            if not shorten_ttl and item is not None:
                expiry = max(expiry, item[0])
            self._items[session_id] = (expiry, json.dumps(changed, separators=(",", ":")))
            self._items.move_to_end(session_id)
            while len(self._items) > self.max_sessions:
                self._items.popitem(last=False)
            return changed

    def get_raw(self, session_id: str) -> tuple[str, float] | None:
        """(JSON, seconds left to live) or None."""
        with self._lock:
            item = self._items.get(session_id)
        if item is None or (left := item[0] - time.monotonic()) <= 0:
            return None
        return item[1], left

    def renew(self, session_ids: list[str]) -> None:
        """Start each held entry's TTL again where that lengthens it (one expired or never written stays absent)."""
        now = time.monotonic()
        with self._lock:
            for session_id in session_ids:
                item = self._items.get(session_id)
                if item is not None and item[0] > now:
                    self._items[session_id] = (max(item[0], now + self.ttl_s), item[1])
                    self._items.move_to_end(session_id)

    def delete(self, session_id: str) -> None:
        with self._lock:
            self._items.pop(session_id, None)

    def __len__(self) -> int:
        return len(self._items)

    def stats(self) -> dict:
        return {"backend": "memory", "healthy": True, "sessions": len(self), **asdict(self.counters)}

    def close(self) -> None:
        pass
