"""A generation's HTTP answer: the whole response once every event is in, or a server-sent event stream opened once
the first event is (so a refused request gets its own status) or a ping's interval has passed without it; and any
failure as OpenAI's error shape."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tandem.gateway.events import ChoiceDelta, ChoiceEnd, Event
from tandem.gateway.openai.errors import OpenAIError, from_exception
from tandem.gateway.openai.json_parts import json_in_parts
from tandem.gateway.openai.streaming import EventStream, until_disconnected

CLIENT_CLOSED = 499  # never seen by the client (it left); what access logs conventionally record


Body = Callable[[AsyncIterator[Event]], AsyncGenerator[bytes, None]]  # an SSE stream's bytes over its events


async def deliver(request: Request, events: AsyncGenerator, stream: bool, collect: Callable[[Event], object],
                  whole: Callable[[], Awaitable[dict]], body: Body, ping_s: float = 0.0) -> Response:
    """A generation's response: `await whole()` once `collect` has taken every event, or an SSE stream of `body`
    over the events, pinged after each `ping_s` seconds without a byte (0: never)."""
    if not stream:
        await until_disconnected(request, collect_all(events, collect))
        # Encoded off the event loop: a body of many choices' logprobs is tens of MB, seconds of json.dumps.
        return Response(await asyncio.to_thread(json_in_parts, await whole()), media_type="application/json")
    # The first event before any byte is sent, so that a refused request (400, 429, 503) gets its own status; but no
    # longer than a ping's interval: past it (a wait for a place, a long prefill) the stream opens and pings until the
    # first event comes, and a failure then travels as an event, as later ones do.
    first = asyncio.ensure_future(first_event(events))
    try:
        await until_disconnected(request, asyncio.wait((first,), timeout=ping_s or None))
        if first.done():
            first.result()  # a refusal raises here, before the headers
    except BaseException:
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await events.aclose()
        raise
    return EventStream(body(_after(first, events)), events, ping_s, first)


async def _after(first: asyncio.Future, events: AsyncIterator[Event]) -> AsyncGenerator[Event, None]:
    """The first event (once `first` has read it), then the rest."""
    yield await first
    async for event in events:
        yield event


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
