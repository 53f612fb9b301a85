"""The gateway loads its engines in a thread of their own that ends with the load (gateway.loading.in_own_thread):
torch's OpenMP pool keeps a team of threads for each thread that ran parallel ops while that thread lives, and a
kept loader team beside the engine's makes libgomp put waiting threads to sleep after every op."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from tandem.gateway.loading import in_own_thread


def parallel_work() -> str:
    x = torch.randn(256, 256)
    (x @ x).sum().item()  # a parallel op: this thread now has an OpenMP team
    return threading.current_thread().name


def loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "tandem-loader"]


def test_the_load_runs_in_a_thread_that_ends_with_it() -> None:
    async def main() -> str:
        return await in_own_thread(parallel_work)

    assert asyncio.run(main()) == "tandem-loader"
    deadline = time.monotonic() + 10
    while loader_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not loader_threads()


def test_a_failed_load_raises_in_the_awaiting_coroutine() -> None:
    def fail() -> None:
        raise ValueError("no such model")

    async def main() -> None:
        await in_own_thread(fail)

    with pytest.raises(ValueError, match="no such model"):
        asyncio.run(main())


def test_a_cancelled_wait_leaves_the_load_to_finish_quietly() -> None:
    release = threading.Event()

    def slow() -> int:
        release.wait(10)
        return 1

    async def main() -> None:
        task = asyncio.ensure_future(in_own_thread(slow))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        await asyncio.sleep(0.2)  # the result arrives for a cancelled future: dropped, no InvalidStateError

    asyncio.run(main())
