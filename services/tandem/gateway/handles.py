"""A request inside a serving loop: its handle (the asyncio queue its updates arrive on), the updates, and where a
session's state lives between its requests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from tandem.core.logprobs import TokenLogprob


class SessionStore(Protocol):
    """Where a session's state lives between its requests (tandem.sessions: memory or Redis): PolicyState.to_dict()
    plus the worker affinity (`draft_worker`, `target_replica`) from the engine's session_affinity."""

    def get(self, session_id: str) -> dict | None: ...

    def put(self, session_id: str, state: dict) -> None: ...


@dataclass(slots=True, frozen=True)
class Finished:
    finish_reason: str
    text_cut: int | None
    completion_tokens: int
    stats: dict


@dataclass(slots=True, frozen=True)
class Update:
    """New tokens for one request; `finished` is set on its last update."""

    token_ids: list[int]
    finished: Finished | None = None
    logprobs: list[TokenLogprob] | None = None  # aligned with token_ids, when the request asked for logprobs
    prompt_logprobs: list[TokenLogprob] | None = None  # in the first update, when the request asked for them


@dataclass(slots=True, eq=False, weakref_slot=True)  # one request: compared, hashed and held weakly by identity
class RequestHandle:
    request_id: str
    prompt_tokens: int
    session_id: str = ""
    abort_requested: bool = False
    updates: asyncio.Queue = field(default_factory=asyncio.Queue)
    trace: object | None = None  # the request's recording span (tracing on): the engine thread adds round spans
    # When its reader last took an update, or the engine finished it: how long its output has waited for a reader.
    unread_since: float = field(default_factory=time.monotonic)

    async def __aiter__(self) -> AsyncIterator[Update]:
        while True:
            item = await self.updates.get()
            self.unread_since = time.monotonic()
            if isinstance(item, Exception):
                raise item
            yield item
            if item.finished is not None:
                return


Delivery = tuple[RequestHandle, Update | Exception]
