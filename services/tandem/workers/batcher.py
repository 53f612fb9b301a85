"""One forward for the calls of every gateway: a worker merges the calls that arrive while it is busy.

A shared pool's worker serves many gateways (and several engine lanes in each). Calls run concurrently on the actor's
threads; the first caller to find the worker idle becomes the leader: it waits the admission window for others to
join, takes every call queued by then, runs them as one batch and hands each caller its own rows. Calls that arrive
during that forward queue for the next one, so rows join and leave per step and the window bounds the wait. A merged
call that reports lost sequences or a full cache is rerun call by call, so each caller gets the answer to its own
rows (both are raised before the forward writes anything, so the rerun is safe). One that reports a refused row
(a request that cannot go on: another gateway's, as often as not) gives the refusal to the call holding that row and
reruns the others: a call's rows resend what they keep and append (core.protocol), so a forward that wrote part of
their caches before the refusal is rerun from the same point.

Whichever thread leads, the model itself only ever runs on one thread of the worker's (`on_model_thread`): loading,
forwards and cache releases alike. torch's CPU thread pool is OpenMP's, which keeps a team of threads for every
thread that ran a parallel op; with more of them than CPUs, libgomp puts waiting threads to sleep after every op, and
a worker whose forwards ran on its 64 call threads in turn would soon run every op that way.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:  # (worker_base builds its batcher from this module)
    from tandem.workers.worker_base import WorkerReply

RECENT_CALLS = 100  # forwards the rows-per-call mean is taken over
T = TypeVar("T")


@dataclass(slots=True)
class _Call:
    requests: list
    reply: WorkerReply | None = None
    error: BaseException | None = None


@dataclass(slots=True)
class BatchStats:
    forwards: int = 0
    calls: int = 0
    rows: int = 0
    merged: int = 0  # forwards that served more than one call (several gateways or lanes)
    busy_s: float = 0.0  # seconds spent in forwards: over a stretch of wall time, how busy the worker was
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_CALLS))  # (rows, calls) per forward

    def rows_per_forward(self) -> float:
        return sum(r for r, _ in self.recent) / len(self.recent) if self.recent else 0.0

    def calls_per_forward(self) -> float:
        return sum(c for _, c in self.recent) / len(self.recent) if self.recent else 0.0


class CallBatcher:
    def __init__(self, run: Callable[[list], WorkerReply], window_s: float = 0.002) -> None:
        self.run, self.window_s = run, window_s
        self.stats = BatchStats()
        self._cond = threading.Condition()
        self._queue: list[_Call] = []
        self._busy = False
        # The one thread that runs the model: loading, forwards and releases queue for it in the order they come.
        self._model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-model")

    def on_model_thread(self, call: Callable[..., T], *args) -> T:
        """`call(*args)` on the worker's model thread, after every call queued before it (loading, forwards,
        releasing caches, reading them)."""
        return self._model_thread.submit(call, *args).result()

    def submit(self, requests: list) -> WorkerReply:
        call = _Call(requests)
        with self._cond:
            self._queue.append(call)
            while self._busy and call.reply is None and call.error is None:
                self._cond.wait()
            if call.reply is not None or call.error is not None:
                return self._answer(call)
            self._busy = True
        try:
            if self.window_s > 0:
                time.sleep(self.window_s)
            with self._cond:
                calls, self._queue = self._queue, []
            self._run(calls)
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
        return self._answer(call)

    @staticmethod
    def _answer(call: _Call) -> WorkerReply:
        if call.error is not None:
            raise call.error
        return call.reply

    def _run(self, calls: list[_Call]) -> None:
        merged = [r for call in calls for r in call.requests]
        if len(calls) > 1:  # one caller's multi-step rows would hold the others' replies: a merged call runs one step
            merged = [dataclasses.replace(r, steps=1) if getattr(r, "steps", 1) > 1 else r for r in merged]
        self.stats.forwards += 1
        self.stats.calls += len(calls)
        self.stats.rows += len(merged)
        self.stats.merged += len(calls) > 1
        self.stats.recent.append((len(merged), len(calls)))
        started = time.perf_counter()
        try:
            reply = self.on_model_thread(self._forward, calls, merged)
            if reply is None:  # answered call by call
                return
        except BaseException as exc:  # every caller of the failed forward sees the failure
            for call in calls:
                if call.reply is None:
                    call.error = exc
            return
        finally:
            self.stats.busy_s += time.perf_counter() - started
        start = 0
        for call in calls:
            end = start + len(call.requests)
            call.reply = dataclasses.replace(reply, spans=None, results=reply.results[start:end]
                                             if reply.results is not None else None)
            start = end

    def _forward(self, calls: list[_Call], merged: list) -> WorkerReply | None:
        """The merged forward; where it reports lost sequences, a full cache or a refused row, each call's own (None
        then)."""
        reply = self.run(merged)
        if len(calls) > 1 and reply.results is None:
            for call in calls:
                refused = reply.refused is not None and any(
                    getattr(request, "seq_id", request) == reply.refused[0] for request in call.requests)
                call.reply = reply if refused else self.run(call.requests)
            return None
        return reply
