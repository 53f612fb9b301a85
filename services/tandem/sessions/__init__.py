"""Per-session speculation state (policy state, worker affinity), in memory or shared through Redis."""

from tandem.sessions.embedded import EmbeddedRedis, find_redis_server
from tandem.sessions.store import (
    DEFAULT_TTL_S,
    KEY_PREFIX,
    MemorySessionStore,
    RedisSessionStore,
    SessionStore,
    StoreCounters,
    open_session_store,
)

__all__ = [
    "DEFAULT_TTL_S",
    "KEY_PREFIX",
    "EmbeddedRedis",
    "MemorySessionStore",
    "RedisSessionStore",
    "SessionStore",
    "StoreCounters",
    "find_redis_server",
    "open_session_store",
]
