"""A request inside a serving loop: what the gateway submits, its handle (the asyncio queue its updates arrive on), the
updates, the queue's bound, and where a session's state lives between its requests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from tandem.core.config import SamplingParams
from tandem.core.logprobs import TokenLogprob
from tandem.core.stats import SpeculationReport
from tandem.gateway.events import QueueFull


class SessionStore(Protocol):
    """Where a session's state lives between its requests (tandem.sessions: memory or Redis): PolicyState.to_dict()
    plus the worker affinity (`draft_worker`, `target_replica`) from the engine's session_affinity."""

    def get(self, session_id: str) -> dict | None: ...

    def put(self, session_id: str, state: dict) -> None: ...


@dataclass(slots=True, frozen=True)
class Submission:
    """A request as the gateway hands it to a serving loop (an EngineLoop, or gateway.lanes over several): its tokens
    and sampling, its ids, and how it runs. `max_k`: None lets the policy decide, 0 is plain decoding; `trace`: its
    span; `cache_scope`: the requests whose cached prompt prefixes it may share (its tenant's); `priority`: lower
    runs first (core.engine); `prediction`: the tokens its output is expected to repeat (core.prediction)."""

    prompt: list[int]
    params: SamplingParams
    request_id: str
    session_id: str = ""
    max_k: int | None = None
    trace: object | None = None
    cache_scope: str = ""
    priority: int = 0
    prediction: tuple[int, ...] = ()


@dataclass(slots=True, frozen=True)
class Finished:
    finish_reason: str
    text_cut: int | None
    completion_tokens: int
    stats: SpeculationReport


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


def check_room(active: int, unread: int, max_requests: int) -> None:
    """QueueFull where the queue's places are all taken: by requests queued or running, and by finished ones whose
    clients have not read all their output."""
    if active + unread >= max_requests:
        raise QueueFull(f"queue full: {active} requests queued or running" +
                        (f" and {unread} finished whose clients have not read their output" if unread else "") +
                        f" (limit {max_requests})")
