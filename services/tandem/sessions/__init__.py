"""Per-session speculation state (policy state, worker affinity), in memory or shared through Redis."""

from tandem.sessions.connection import RedisSetupError, configured_password, redact_url, with_credentials
from tandem.sessions.embedded import EmbeddedRedis, find_redis_server
from tandem.sessions.redis_store import KEY_PREFIX, RedisSessionStore, open_session_store
from tandem.sessions.store import (
    DEFAULT_TTL_S,
    MemorySessionStore,
    SessionStore,
    StoreCounters,
    StoreUnavailable,
    UpdateConflict,
)

__all__ = [
    "DEFAULT_TTL_S",
    "KEY_PREFIX",
    "EmbeddedRedis",
    "MemorySessionStore",
    "RedisSessionStore",
    "RedisSetupError",
    "SessionStore",
    "StoreCounters",
    "StoreUnavailable",
    "UpdateConflict",
    "configured_password",
    "find_redis_server",
    "open_session_store",
    "redact_url",
    "with_credentials",
]
