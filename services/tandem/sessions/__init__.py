"""Per-session speculation state (policy state, worker affinity), in memory or shared through Redis."""

from tandem.sessions.connection import RedisSetupError, configured_password, redact_url, with_credentials
from tandem.sessions.embedded import EmbeddedRedis, find_redis_server
from tandem.sessions.store import (
    DEFAULT_TTL_S,
    KEY_PREFIX,
    MemorySessionStore,
    RedisSessionStore,
    SessionStore,
    StoreCounters,
    StoreUnavailable,
    UpdateConflict,
    open_session_store,
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
