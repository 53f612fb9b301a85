"""Per-session state in Redis, with an in-memory fallback that keeps serving through outages.

Redis makes a session's state survive a gateway restart and lets gateway replicas share it. When Redis is
unreachable, `RedisSessionStore` logs once per outage, counts, serves from memory (a write-through copy of recently
used sessions plus everything written during the outage), and probes Redis again with exponential backoff, so a dead
Redis costs one short socket timeout per probe, never one per call. On recovery it writes the sessions changed during
the outage back to Redis (last writer wins against other replicas; sessions.outages).
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from dataclasses import asdict
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tandem.sessions.connection import SCHEMES, RedisSetupError, redact_url, setup_problem
from tandem.sessions.outages import RedisOutages
from tandem.sessions.store import (
    DEFAULT_MAX_SESSIONS,
    DEFAULT_TTL_S,
    Change,
    MemorySessionStore,
    SessionStore,
    StoreCounters,
    UpdateConflict,
)

log = logging.getLogger(__name__)

KEY_PREFIX = "tandem:session:"
# Optimistic transactions on one key (update) tried this many times before giving up: each retry means another
# writer changed the key between this one's read and write, so hitting the bound takes a storm of writers on one key.
MAX_UPDATE_TRIES = 32
# A write served from memory is tried on Redis again where Redis came back before it was remembered for the write-back
# (outages._fallback): so many tries in all.
WRITE_TRIES = 2
# After a conflict a writer waits a random time up to base * 2**try (capped) before reading again: without it the
# writer that lost keeps losing to the same busy ones (4 threads on one key, on 2 loaded cores, gave up after 32 tries
# in 2 of 100 runs of 200 updates); with it the writers spread out. Before giving up it has waited 0.3 s on average.
_CONFLICT_BACKOFF_S = 0.0005
_CONFLICT_BACKOFF_MAX_S = 0.02
# renew's TTLs, set only where they lengthen one (PEXPIRE's GT, which this does, came with Redis 7).
_LENGTHEN_TTLS = """
for _, key in ipairs(KEYS) do
  local left = redis.call('PTTL', key)
  if left >= 0 and left < tonumber(ARGV[1]) then redis.call('PEXPIRE', key, ARGV[1]) end
end
"""


class RedisSessionStore(RedisOutages):
    """Sessions in Redis under `tandem:session:<id>` as JSON with a TTL; serves from memory while Redis is down."""

    def __init__(
        self,
        url: str,
        ttl_s: float = DEFAULT_TTL_S,
        *,
        prefix: str = KEY_PREFIX,
        socket_timeout_s: float = 0.3,
        retry_initial_s: float = 0.5,
        retry_max_s: float = 15.0,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        strict: bool = False,
    ) -> None:
        """strict: a read or an update that cannot reach Redis raises StoreUnavailable instead of using this process's
        copy: for records every replica changes (a conversation's items, an id's owner), where two replicas' changes
        made in memory during an outage would leave one of them at the write-back, though both were acknowledged,
        and a copy may be another replica's change behind. A put or delete (of a record of its own) still waits in
        memory for the write-back; that is all a strict store keeps in memory (it serves nothing from there, and a
        copy of every record read or written would hold, say, each uploaded file in every gateway). Each call asks
        Redis, whatever the backoff: there is no copy to fall back on."""
        self.url = url
        self.strict = strict
        self.ttl_s = float(ttl_s)
        self.prefix = prefix
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self.counters = StoreCounters()
        self._memory = MemorySessionStore(ttl_s, max_sessions)
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0),  # the default retries 10 times, stalling callers while Redis is down
            retry_on_timeout=False,
            decode_responses=True,
        )
        self._lock = threading.Lock()
        self._healthy = True
        self._backoff_s = retry_initial_s
        self._next_try = 0.0
        self._dirty: set[str] = set()  # sessions put or deleted during an outage, to write back on recovery

    @property
    def healthy(self) -> bool:
        return self._healthy

    def check(self) -> bool:
        """At start: True when Redis answers; False when it cannot be reached (an outage: served from memory and
        retried); RedisSetupError when it refuses our password or TLS, which no retry would fix."""
        try:
            self._client.ping()
        except redis.RedisError as error:
            if (problem := setup_problem(error, self.url)) is not None:
                raise RedisSetupError(problem) from None  # (the redis-py error is in the message; no URL in it)
            self._failed(error, probe=False)
            return False
        return True

    def _key(self, session_id: str) -> str:
        return self.prefix + session_id

    def get(self, session_id: str) -> dict | None:
        ok, value = self._redis(lambda client: client.get(self._key(session_id)))
        if not ok:
            self._refuse_if_strict()
            self._fallback()
            return self._memory.get(session_id)
        return self._read(session_id, value)

    def get_many(self, session_ids: list[str]) -> list[dict | None]:
        """get for each id, in one round trip."""
        if not session_ids:
            return []
        ok, values = self._redis(lambda client: client.mget([self._key(session_id) for session_id in session_ids]))
        if not ok:
            self._refuse_if_strict()
            self._fallback()
            return self._memory.get_many(session_ids)
        return [self._read(session_id, value) for session_id, value in zip(session_ids, values, strict=True)]

    def _read(self, session_id: str, value: str | None) -> dict | None:
        """The state Redis answered with for `session_id` (None: none), its copy in memory kept in step."""
        if value is None:
            self._memory.delete(session_id)
            return None
        try:
            state = json.loads(value)
        except ValueError:
            log.warning("session %s: stored state is not JSON; ignoring it", session_id)
            return None
        if not self.strict:  # the copy served through an outage
            self._memory.put_raw(session_id, value)
        return state

    def put(self, session_id: str, state: dict) -> None:
        value = json.dumps(state, separators=(",", ":"))
        if not self.strict:
            self._memory.put_raw(session_id, value)
        for _ in range(WRITE_TRIES):
            ok, _ = self._redis(lambda client: client.set(self._key(session_id), value,
                                                          px=max(1, int(self.ttl_s * 1000))))
            if ok:
                return
            if self.strict:  # kept for the write-back alone
                self._memory.put_raw(session_id, value)
            if self._fallback(session_id):
                return

    def update(self, session_id: str, change: Change, *, shorten_ttl: bool = True) -> dict | None:
        """As MemorySessionStore.update, across every replica: an optimistic transaction (WATCH the key, read it,
        write it in MULTI/EXEC, again from the read when another writer came between), so two replicas changing one
        state at once both have their change. `change` may run more than once. From memory while Redis is down."""
        for _ in range(WRITE_TRIES):
            ok, changed = self._redis(lambda client: self._transaction(client, session_id, change, shorten_ttl))
            if ok:
                break
            self._refuse_if_strict()
            changed = self._memory.update(session_id, change, shorten_ttl=shorten_ttl)  # before it is remembered
            if self._fallback(session_id):
                return changed
        else:
            return changed  # Redis came and went at every try: this replica's memory alone holds it
        if changed is None or self.strict:
            self._memory.delete(session_id)
        else:
            self._memory.put_raw(session_id, json.dumps(changed, separators=(",", ":")))
        return changed

    def _transaction(self, client: redis.Redis, session_id: str, change: Change, shorten_ttl: bool) -> dict | None:
        key = self._key(session_id)
        ttl_ms = max(1, int(self.ttl_s * 1000))
        for attempt in range(MAX_UPDATE_TRIES):
            if attempt:
                time.sleep(random.uniform(0.0, min(_CONFLICT_BACKOFF_MAX_S, _CONFLICT_BACKOFF_S * 2**attempt)))
            with client.pipeline() as pipe:
                try:
                    pipe.watch(key)
                    value = pipe.get(key)
                    left = -1 if shorten_ttl or value is None else pipe.pttl(key)
                    changed = change(None if value is None else json.loads(value))
                    pipe.multi()
                    if changed is None:
                        pipe.delete(key)
                    else:
                        pipe.set(key, json.dumps(changed, separators=(",", ":")), px=max(ttl_ms, left))
                    pipe.execute()
                    return changed
                except redis.WatchError:
                    continue
        raise UpdateConflict(f"{session_id}: changed by other writers on each of {MAX_UPDATE_TRIES} tries")

    def renew(self, session_ids: list[str]) -> None:
        """Start each held state's TTL again where that lengthens it (a replica with a shorter TTL never shortens
        another's), in one round trip; one expired stays absent. Best effort: while Redis is away only this process's
        copies are renewed."""
        self._memory.renew(session_ids)
        keys = [self._key(session_id) for session_id in session_ids]
        ttl_ms = max(1, int(self.ttl_s * 1000))
        if keys and not self._redis(lambda client: client.eval(_LENGTHEN_TTLS, len(keys), *keys, ttl_ms))[0]:
            self._fallback()

    def delete(self, session_id: str) -> None:
        self._memory.delete(session_id)
        for _ in range(WRITE_TRIES):
            ok, _ = self._redis(lambda client: client.delete(self._key(session_id)))
            if ok or self._fallback(session_id):
                return

    def stats(self) -> dict:
        return {
            "backend": "redis",
            "url": redact_url(self.url),
            "healthy": self._healthy,
            "sessions_in_memory": len(self._memory),
            "pending_write_back": len(self._dirty),
            **asdict(self.counters),
        }

    def close(self) -> None:
        self._client.close()


def open_session_store(url: str | None, ttl_s: float = DEFAULT_TTL_S, *, check: bool = True,
                       **options) -> SessionStore:
    """A store for `url`: None, "" or "memory" -> in memory; a redis:// / rediss:// / unix:// URL -> Redis.
    `check`: ping it now, so that a wrong password or TLS setting fails at start (RedisSetupError) rather than
    every session quietly living in memory; an unreachable Redis is an outage the store rides out."""
    if not url or url == "memory":
        return MemorySessionStore(ttl_s, **{k: v for k, v in options.items() if k == "max_sessions"})
    if urlsplit(url).scheme not in SCHEMES:
        raise ValueError(f"unsupported session store URL {redact_url(url)!r}: expected redis://host:port/db or "
                         "'memory'")
    store = RedisSessionStore(url, ttl_s, **options)
    if check:
        try:
            store.check()
        except RedisSetupError:
            store.close()
            raise
    return store
