"""Tie a generation's lifetime to its HTTP client: a client that goes away cancels the work and frees the caches.

The gateway's generation stream cancels every choice when it is closed. Three places must close it:
- while the handler waits (a whole response, or a stream's first event): `until_disconnected` races the work against
  the ASGI `http.disconnect` message, since Starlette does not cancel a handler whose client left;
- while an SSE response streams: Starlette cancels the sending task on disconnect, and `EventStream` then closes both
  its body and the generation stream, whether or not the body had started (a never-started async generator's
  `finally` would not run);
- on server shutdown, uvicorn cancels what is left, which reaches the same `finally`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Awaitable
from typing import TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tandem.gateway.interleave import interleave

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientGone after cancelling it if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientGone
    finally:
        watcher.cancel()
        if not task.done():  # this handler itself was cancelled (server shutdown)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


class EventStream(StreamingResponse):
    """text/event-stream over `body`; `events` (the generation stream that feeds it) is closed when it ends."""

    def __init__(self, body: AsyncGenerator[bytes, None], events: AsyncGenerator) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._body = body
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._body.aclose()
            await self._events.aclose()


async def _renumbered(stream: AsyncGenerator, offset: int) -> AsyncGenerator:
    async with contextlib.aclosing(stream):
        async for event in stream:
            yield dataclasses.replace(event, index=event.index + offset)


def merged(streams: list[AsyncGenerator], stride: int) -> AsyncGenerator:
    """Several prompts' generation streams (a completions request's batch of prompts) as one, their events as they
    come, prompt i's choice j renumbered i * stride + j (OpenAI's numbering; stride: the choices per prompt). The
    first failure ends it; closing it closes every stream, which cancels their choices and frees their caches."""
    return interleave([_renumbered(stream, index * stride) for index, stream in enumerate(streams)])
