"""A generation's HTTP answer: the whole response once every event is in, or a server-sent event stream opened once
the first event is (so a refused request gets its own status); and any failure as OpenAI's error shape."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tandem.gateway.events import ChoiceDelta, ChoiceEnd, Event
from tandem.gateway.openai.errors import OpenAIError, from_exception
from tandem.gateway.openai.streaming import EventStream, until_disconnected

CLIENT_CLOSED = 499  # never seen by the client (it left); what access logs conventionally record


async def deliver(request: Request, events: AsyncGenerator, stream: bool, collect: Callable[[Event], object],
                  whole: Callable[[], Awaitable[dict]], body: Callable[[Event], AsyncGenerator[bytes, None]]
                  ) -> Response:
    """A generation's response: `await whole()` once `collect` has taken every event, or an SSE stream of
    `body(first)`."""
    if not stream:
        await until_disconnected(request, collect_all(events, collect))
        # Encoded off the event loop: a body of many choices' logprobs is tens of MB, seconds of json.dumps.
        return await asyncio.to_thread(JSONResponse, await whole())
    try:
        # The first event before any byte is sent: a refused request (400, 429, 503) gets its own status.
        first = await until_disconnected(request, first_event(events))
    except BaseException:
        await events.aclose()
        raise
    return EventStream(body(first), events)


def error_response(exc: Exception, renames: dict[str, str]) -> JSONResponse:
    error = exc if isinstance(exc, OpenAIError) else from_exception(exc, renames)
    return error.response()


async def collect_all(events: AsyncGenerator, collect: Callable[[Event], object]) -> None:
    async with contextlib.aclosing(events):
        async for event in events:
            collect(event)


async def first_event(events: AsyncGenerator) -> ChoiceDelta | ChoiceEnd:
    async for event in events:
        return event
    raise RuntimeError("the generation stream ended without an event")
