"""Where the canary state and the arms' observation windows live: Redis (shared by gateway replicas and the CLI) or
process memory (one gateway without Redis, tests).

Redis keys, for deployment D:
    tandem:canary:D                      the CanaryState as JSON (changed only in WATCH/MULTI transactions)
    tandem:canary:D:obs:<generation>:<arm>  a list of Outcome JSON, trimmed to the newest `window`, expiring
    tandem:canary:D:evaluation           the latest analysis (per-arm summaries and verdicts) as JSON
"""

from __future__ import annotations

import json
import threading
from collections import defaultdict, deque
from collections.abc import Callable, Mapping
from typing import Protocol
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tandem.canary.observations import Outcome
from tandem.canary.state import CanaryState
from tandem.errors import InvalidArgument, TandemError
from tandem.sessions.connection import redact_url

KEY_PREFIX = "tandem:canary:"
OBSERVATION_TTL_S = 7 * 24 * 3600
MAX_UPDATE_ATTEMPTS = 16
Updater = Callable[[CanaryState | None], CanaryState | None]
Batches = Mapping[tuple[int, str], list[Outcome]]


class CanaryStoreError(TandemError):
    """The store (Redis) could not be reached or answered with an error."""


class CanaryStore(Protocol):
    def load(self, deployment: str) -> CanaryState | None: ...

    def update(self, deployment: str, change: Updater, replace_invalid: bool = False) -> CanaryState | None:
        """Apply `change` to the current state atomically; it returns the new state, or None to leave it as is.
        replace_invalid: a stored state that does not parse reaches `change` as None (else: CanaryStoreError)."""
        ...

    def append(self, deployment: str, batches: Batches, window: int) -> None: ...

    def outcomes(self, deployment: str, generation: int, arm: str, window: int) -> list[Outcome]: ...

    def put_evaluation(self, deployment: str, evaluation: dict) -> None: ...

    def evaluation(self, deployment: str) -> dict | None: ...

    def close(self) -> None: ...


def parse_state(text: str | None, where: str, replace_invalid: bool = False) -> CanaryState | None:
    """The stored JSON as a CanaryState; a document that does not parse is a store error, not a caller's (or, to
    overwrite it, None)."""
    if not text:
        return None
    try:
        return CanaryState.from_json(text)
    except (ValueError, KeyError, TypeError) as exc:
        if replace_invalid:
            return None
        raise CanaryStoreError(f"{where}: stored canary state is invalid ({exc}); fix it with `tandem canary set "
                               "--arms`") from exc


def parse_outcomes(items: list[str]) -> list[Outcome]:
    """Stored outcomes; one that does not parse (written by another version, say) is skipped."""
    parsed = []
    for item in items:
        try:
            parsed.append(Outcome.from_json(item))
        except (ValueError, KeyError, TypeError):
            continue
    return parsed


class MemoryCanaryStore:
    """Process-local and thread-safe; for a single gateway without Redis, and tests."""

    def __init__(self) -> None:
        self._states: dict[str, str] = {}
        self._outcomes: dict[tuple[str, int, str], deque[str]] = defaultdict(deque)
        self._evaluations: dict[str, str] = {}
        self._lock = threading.Lock()

    def load(self, deployment: str) -> CanaryState | None:
        with self._lock:
            text = self._states.get(deployment)
        return parse_state(text, deployment)

    def update(self, deployment: str, change: Updater, replace_invalid: bool = False) -> CanaryState | None:
        with self._lock:
            current = parse_state(self._states.get(deployment), deployment, replace_invalid)
            new = change(current)
            if new is None:
                return current
            self._states[deployment] = new.to_json()
            return new

    def append(self, deployment: str, batches: Batches, window: int) -> None:
        with self._lock:
            for (generation, arm), items in batches.items():
                stored = self._outcomes[deployment, generation, arm]
                stored.extend(item.to_json() for item in items)
                while len(stored) > window:
                    stored.popleft()

    def outcomes(self, deployment: str, generation: int, arm: str, window: int) -> list[Outcome]:
        with self._lock:
            stored = list(self._outcomes.get((deployment, generation, arm), ()))[-window:]
        return parse_outcomes(stored)

    def put_evaluation(self, deployment: str, evaluation: dict) -> None:
        with self._lock:
            self._evaluations[deployment] = json.dumps(evaluation)

    def evaluation(self, deployment: str) -> dict | None:
        with self._lock:
            text = self._evaluations.get(deployment)
        return json.loads(text) if text else None

    def close(self) -> None:
        pass


class RedisCanaryStore:
    def __init__(self, url: str, *, prefix: str = KEY_PREFIX, socket_timeout_s: float = 1.0) -> None:
        self.url, self.prefix = url, prefix
        self._client = redis.Redis.from_url(url, socket_timeout=socket_timeout_s,
                                            socket_connect_timeout=socket_timeout_s, retry=Retry(NoBackoff(), 0),
                                            retry_on_timeout=False, decode_responses=True)

    def state_key(self, deployment: str) -> str:
        return self.prefix + deployment

    def outcomes_key(self, deployment: str, generation: int, arm: str) -> str:
        return f"{self.prefix}{deployment}:obs:{generation}:{arm}"

    def _call(self, op: Callable[[redis.Redis], object]):
        try:
            return op(self._client)
        except redis.RedisError as exc:
            raise CanaryStoreError(f"redis: {redact_url(self.url)}: {exc}") from exc

    def load(self, deployment: str) -> CanaryState | None:
        text = self._call(lambda client: client.get(self.state_key(deployment)))
        return parse_state(text, self.state_key(deployment))

    def update(self, deployment: str, change: Updater, replace_invalid: bool = False) -> CanaryState | None:
        key = self.state_key(deployment)

        def transaction(client: redis.Redis) -> CanaryState | None:
            with client.pipeline() as pipe:
                for _ in range(MAX_UPDATE_ATTEMPTS):
                    try:
                        pipe.watch(key)
                        current = parse_state(pipe.get(key), key, replace_invalid)
                        new = change(current)
                        if new is None:
                            pipe.unwatch()
                            return current
                        pipe.multi()
                        pipe.set(key, new.to_json())
                        pipe.execute()
                        return new
                    except redis.WatchError:
                        continue  # another replica or the CLI changed it meanwhile: re-read and re-apply
            raise CanaryStoreError(f"redis: {key} kept changing; gave up after {MAX_UPDATE_ATTEMPTS} attempts")

        return self._call(transaction)

    def append(self, deployment: str, batches: Batches, window: int) -> None:
        def push(client: redis.Redis) -> None:
            pipe = client.pipeline(transaction=False)
            for (generation, arm), items in batches.items():
                if not items:
                    continue
                key = self.outcomes_key(deployment, generation, arm)
                pipe.rpush(key, *(item.to_json() for item in items))
                pipe.ltrim(key, -window, -1)
                pipe.expire(key, OBSERVATION_TTL_S)
            pipe.execute()

        self._call(push)

    def outcomes(self, deployment: str, generation: int, arm: str, window: int) -> list[Outcome]:
        items = self._call(lambda client: client.lrange(self.outcomes_key(deployment, generation, arm), -window, -1))
        return parse_outcomes(items)

    def put_evaluation(self, deployment: str, evaluation: dict) -> None:
        self._call(lambda client: client.set(f"{self.prefix}{deployment}:evaluation", json.dumps(evaluation),
                                             ex=OBSERVATION_TTL_S))

    def evaluation(self, deployment: str) -> dict | None:
        text = self._call(lambda client: client.get(f"{self.prefix}{deployment}:evaluation"))
        return json.loads(text) if text else None

    def close(self) -> None:
        self._client.close()


def open_canary_store(url: str | None, **options) -> CanaryStore:
    """None, "" or "memory" -> in memory; a redis:// / rediss:// / unix:// URL -> Redis."""
    if not url or url == "memory":
        return MemoryCanaryStore()
    if urlsplit(url).scheme not in ("redis", "rediss", "unix"):
        raise InvalidArgument(f"redis_url: expected redis://host:port/db (or rediss://, unix://), got {url!r}")
    return RedisCanaryStore(url, **options)
