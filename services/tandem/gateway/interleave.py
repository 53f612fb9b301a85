"""Several async generators' items as one stream, as they come: a request's n choices (gateway.generation) and a
completions request's batch of prompts (gateway.openai.streaming)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence
from typing import TypeVar

T = TypeVar("T")


async def interleave(streams: Sequence[AsyncGenerator[T, None]]) -> AsyncGenerator[T, None]:
    """Every stream's items, each as soon as its stream yields it, until all have ended. The first failure ends it,
    raised here; ending or closing it cancels the streams still running, each unwinding through its own `finally`
    (a generation frees its caches there)."""
    queue: asyncio.Queue = asyncio.Queue()
    ended = object()

    async def pump(stream: AsyncGenerator[T, None]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    queue.put_nowait(item)
        except Exception as exc:
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(ended)

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is ended:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
