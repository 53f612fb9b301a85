"""The gateway loads its engines in a thread of their own that ends with the load (gateway.loading.in_own_thread):
torch's OpenMP pool keeps a team of threads for each thread that ran parallel ops while that thread lives, and a
kept loader team beside the engine's makes libgomp put waiting threads to sleep after every op."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from tandem.gateway.loading import LOADER_THREAD, in_own_thread


def parallel_work() -> str:
    x = torch.randn(256, 256)
    (x @ x).sum().item()  # a parallel op: this thread now has an OpenMP team
    return threading.current_thread().name


def loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == LOADER_THREAD]


def test_the_load_runs_in_a_thread_that_ends_with_it() -> None:
    async def main() -> str:
        return await in_own_thread(parallel_work)

    assert asyncio.run(main()) == LOADER_THREAD
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


# The gateway's load replaced by parallel torch work that runs until the test ends it, then the `tandem serve` command.
STOPPED_WHILE_LOADING = """
import sys, torch
import tandem.engines
from tandem.cli.main import run

def load(build):
    print("loading", flush=True)
    x = torch.randn(384, 384)
    while True:
        x = torch.tanh(x @ x)

tandem.engines.build = load
sys.argv[1:] = ["serve", "--in-process", "--target", sys.argv[1], "--draft", sys.argv[2], "--port", "0",
               "--http-port", "-1", "--metrics-port", "-1", "--calibration-file", ""]
sys.exit(run())  # the `tandem` command's entry
"""


def test_a_gateway_stopped_while_its_models_load_exits_cleanly(tiny_dirs, tmp_path) -> None:
    """SIGTERM during start-up drained the gateway, and the interpreter then finalized under the loader thread,
    still inside an OpenMP region: `terminate called without an active exception`, status 134."""
    env = {**os.environ, "TANDEM_HOME": str(tmp_path), "OMP_NUM_THREADS": "2"}
    serve = subprocess.Popen([sys.executable, "-c", STOPPED_WHILE_LOADING, str(tiny_dirs.target), str(tiny_dirs.draft)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        while (line := serve.stdout.readline()) and line.strip() != "loading":
            pass
        time.sleep(0.5)  # inside the parallel loop
        serve.send_signal(signal.SIGTERM)
        _, err = serve.communicate(timeout=60)
    finally:
        serve.kill()
    assert serve.returncode == 0, err[-2000:]
    assert "terminate called" not in err and "Traceback" not in err
