"""Tie a generation's lifetime to its HTTP client: a client that goes away cancels the work and frees the caches.

The gateway's generation stream cancels every choice when it is closed. Three places must close it:
- while the handler waits (a whole response, or a stream's first event): `until_disconnected` races the work against
  the ASGI `http.disconnect` message, since Starlette does not cancel a handler whose client left;
- while an SSE response streams: Starlette cancels the sending task on disconnect, and `EventStream` then closes both
  its body and the generation stream, whether or not the body had started (a never-started async generator's
  `finally` would not run);
- on server shutdown, uvicorn cancels what is left, which reaches the same `finally`.

A stream that sends nothing for a while (a request waiting for a place, a long prefill on a CPU) is cut by whatever
proxies it and times out idle reads: nginx's proxy_read_timeout and AWS ALB's idle timeout, 60 s by default. So
`EventStream` sends an SSE comment (`: ping`, which every client's parser skips) after each `ping_s` without a byte,
as sse-starlette does; that package also patches uvicorn's exit handler to end every stream at shutdown, where the
gateway lets them finish within its grace, so the few lines are here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator, Awaitable
from typing import TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from tandem.gateway.interleave import interleave

T = TypeVar("T")

PING = b": ping\n\n"


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
    """text/event-stream over `body`; when it ends, `events` (the generation stream that feeds it) is closed and
    `first` (the task reading its first event, if any) cancelled where the stream ended before it. A comment goes
    after each `ping_s` seconds without a byte (0: none)."""

    def __init__(self, body: AsyncGenerator[bytes, None], events: AsyncGenerator, ping_s: float = 0.0,
                 first: asyncio.Future | None = None) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._body = body
        self._events = events
        self._ping_s = ping_s
        self._first = first

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pinger = _Pinger(send, self._ping_s) if self._ping_s > 0 else None
        try:
            await super().__call__(scope, receive, pinger.send if pinger is not None else send)
        finally:
            for task in (pinger.task if pinger is not None else None, self._first):
                if task is not None:  # (a ping whose send failed, the client gone: its error is read here)
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
            await self._body.aclose()
            await self._events.aclose()


class _Pinger:
    """`send`, and a task that sends PING once the response has started and `every_s` seconds have passed without
    a byte; one message at a time (a send waits while the client reads slowly)."""

    def __init__(self, send: Send, every_s: float) -> None:
        self._send, self._every_s = send, every_s
        self._lock = asyncio.Lock()
        self._last = time.monotonic()
        self._ended = False
        self.task: asyncio.Task | None = None

    async def send(self, message: Message) -> None:
        async with self._lock:
            await self._send(message)
            self._last = time.monotonic()
        if message["type"] == "http.response.start":
            self.task = asyncio.ensure_future(self._ping())
        elif not message.get("more_body", False):
            self._ended = True

    async def _ping(self) -> None:
        while True:
            await asyncio.sleep(max(0.0, self._last + self._every_s - time.monotonic()))
            async with self._lock:
                if self._ended:
                    return
                if time.monotonic() - self._last >= self._every_s:
                    await self._send({"type": "http.response.body", "body": PING, "more_body": True})
                    self._last = time.monotonic()


async def _renumbered(stream: AsyncGenerator, offset: int) -> AsyncGenerator:
    async with contextlib.aclosing(stream):
        async for event in stream:
            yield dataclasses.replace(event, index=event.index + offset)


def merged(streams: list[AsyncGenerator], stride: int) -> AsyncGenerator:
    """Several prompts' generation streams (a completions request's batch of prompts) as one, their events as they
    come, prompt i's choice j renumbered i * stride + j (OpenAI's numbering; stride: the choices per prompt). The
    first failure ends it; closing it closes every stream, which cancels their choices and frees their caches."""
    return interleave([_renumbered(stream, index * stride) for index, stream in enumerate(streams)])
