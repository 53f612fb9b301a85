"""The gateway's one hook for an edge plug-in that splits requests over arms (the canary: tandem.canary.plugin).

The gateway serves one backend per arm, the first the baseline. A plug-in is handed to it as an `ArmRouterFactory`;
once every arm's engine runs, the gateway starts it (`start`) with what only the gateway has: the arms it serves,
plain greedy decoding on the baseline (`PlainDecoder`, for checks that speculation stayed exact) and its metrics'
MeterProvider. The started `ArmRouter` places each request (`route`: None keeps it on the baseline, unrecorded) and
is told how each placed request ended (`record`). Without a plug-in every request runs on the baseline and nothing
of the canary is imported.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tandem.core.config import SamplingParams
from tandem.gateway.handles import Submission
from tandem.gateway.lanes import ServingLoop
from tandem.gateway.validate import BACKGROUND_PRIORITY

PlainDecoder = Callable[[list[int], int], list[int]]  # (prompt ids, n) -> the first n tokens of plain greedy decoding


class ArmRoute(Protocol):
    """Where one request was placed; the router gets it back with the request's outcome."""

    @property
    def arm(self) -> str: ...


@dataclass(slots=True, frozen=True)
class ArmOutcome:
    """How a placed request ended: failed in the engine (an error or a stall; a shutdown is not reported), or what it
    produced and when (time.monotonic seconds)."""

    failed: bool = False
    prompt_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    greedy: bool = False
    completion_tokens: int = 0
    stats: dict = field(default_factory=dict)
    first_token_at: float | None = None
    finished_at: float | None = None


class ArmRouter(Protocol):
    def route(self, session_id: str, request_id: str, tenant: str) -> ArmRoute | None: ...

    def record(self, route: ArmRoute, outcome: ArmOutcome) -> None: ...

    def close(self) -> None:
        """Flush what was recorded and stop (blocking: the gateway calls it off its event loop)."""


class ArmRouterFactory(Protocol):
    def start(self, served: Sequence[str], plain: PlainDecoder, meter_provider: object | None) -> ArmRouter:
        """A started router over the arms `served` here (blocking: the gateway calls it off its event loop)."""


def plain_params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def plain_decoder(serving_loop: ServingLoop, event_loop: asyncio.AbstractEventLoop,
                  timeout_s: float = 120.0) -> PlainDecoder:
    """Plain greedy decoding through a serving loop (a request with max_k=0, no stops, EOS ignored, behind every
    client's request: a check never takes a client's place), callable from any thread but the event loop's own (a
    plug-in's background thread)."""

    async def run(prompt_ids: list[int], n: int) -> list[int]:
        request_id = f"plain-check-{uuid.uuid4().hex}"
        handle = await serving_loop.submit(Submission(prompt_ids, plain_params(n), request_id, max_k=0,
                                                      priority=BACKGROUND_PRIORITY))
        tokens: list[int] = []
        finished = False
        try:
            async for update in handle:
                tokens.extend(update.token_ids)
                finished = update.finished is not None
        finally:
            if not finished:
                serving_loop.cancel(request_id, detach=True)
        return tokens

    def decode(prompt_ids: list[int], n: int) -> list[int]:
        future = asyncio.run_coroutine_threadsafe(run(prompt_ids, n), event_loop)
        try:
            return future.result(timeout_s)
        except BaseException:
            future.cancel()  # a timeout: cancel the request (its `finally` frees the sequence) and give up
            raise

    return decode
