"""The asyncio driver: sends one load level's requests and records a RunTrace, over gRPC or OpenAI's HTTP API.

Rate mode issues request i at the i-th offset of the arrival process (an absolute schedule, so late wake-ups do not
accumulate); concurrency mode runs C workers that each send their next request as soon as the last one ends.
Bounds: `requests` in all; with `duration`, nothing new is issued after `duration` seconds and whatever is still in
flight at `duration + grace` is cancelled (the RPC is cancelled on the wire, or the HTTP connection closed, so the
server frees its caches) and recorded as cancelled; requests never issued leave no record and count as not_sent.
With max_concurrency, a request that arrives while all slots are busy waits for one, and its send time (the start of
its TTFT) is when it gets it, as in vLLM.

The backends (loadtest/backends.py) turn a stream into the same events, so both are timed by the same code here:
the token count of each chunk that carries tokens (its arrival is stamped when the backend hands it over), then the
end of the stream with its usage and speculation stats.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections.abc import Iterable

from loadtest.arrivals import ArrivalProcess
from loadtest.backend_base import Backend, Final, RequestFailed, RequestSpec, ServerUnreachable
from loadtest.backends import backend_for
from loadtest.config import RunConfig
from loadtest.prompts import Prompt, load_set, schedule
from loadtest.trace import CANCELLED, ERROR, OK, RequestTrace, RunTrace

IN_FLIGHT = "in_flight"
__all__ = ["Driver", "ServerUnreachable", "WarmupFailed", "run_level"]


class WarmupFailed(RuntimeError):
    pass


class Driver:
    def __init__(self, config: RunConfig, prompts: list[Prompt] | None = None) -> None:
        self.config = config
        self.prompts = schedule(prompts or load_set(config.prompts, config.lengths), config.requests + config.warmup,
                                config.seed)
        self.run_id = f"lt-{config.speculation}-{uuid.uuid4().hex[:8]}"
        self.start = 0.0
        self.server: dict = {}
        self.partial: RunTrace | None = None  # what a cancelled (Ctrl-C) measurement had recorded when it stopped

    def now(self) -> float:
        return time.perf_counter() - self.start

    def request(self, index: int, prompt: Prompt, tag: str = "") -> RequestSpec:
        config = self.config
        session = index % config.sessions if config.sessions else index
        return RequestSpec(prompt=prompt, request_id=f"{self.run_id}{tag}-{index}",
                           session_id=f"{self.run_id}{tag}-s{session}", max_tokens=config.max_tokens,
                           temperature=config.temperature,
                           seed=config.seed * 1_000_003 + index if config.temperature > 0 else None,
                           ignore_eos=config.ignore_eos, speculation=config.speculation, max_k=config.max_k,
                           priority=config.priority)

    async def send(self, backend: Backend, request: RequestSpec, trace: RequestTrace) -> RequestTrace:
        """One streamed request, recorded into trace; never raises except CancelledError."""
        trace.status, trace.send = IN_FLIGHT, self.now()
        final: Final | None = None
        try:
            async with contextlib.aclosing(backend.stream(request)) as events:
                async for event in events:
                    if isinstance(event, Final):
                        trace.end, final = self.now(), event  # the Complete, or the SSE chunk with finish_reason
                    elif event:
                        trace.chunk_times.append(self.now())
                        trace.chunk_tokens.append(event)
            if final is None:
                trace.end, trace.status, trace.error = self.now(), ERROR, "INCOMPLETE: the stream had no end"
            else:
                _record_final(trace, final)  # after the stream: OpenAI's usage comes after the finish chunk
        except RequestFailed as exc:
            trace.end, trace.status, trace.error = self.now(), ERROR, str(exc)
        except asyncio.CancelledError:
            trace.end, trace.status = self.now(), CANCELLED
            raise
        return trace

    async def warm_up(self, backend: Backend) -> None:
        for index in range(self.config.warmup):
            trace = await self.send(backend, self.request(index, self.prompts[index], "-warmup"), RequestTrace(index))
            if trace.status != OK:
                raise WarmupFailed(trace.error)

    async def run(self) -> RunTrace:
        async with backend_for(self.config) as backend:
            self.server = await backend.open()
            await self.warm_up(backend)
            return await self.measure(backend)

    async def measure(self, backend: Backend) -> RunTrace:
        config = self.config
        measured = self.prompts[config.warmup:]
        # Requests and their records are made when sent, so a large --requests with a short --duration starts at once.
        traces: list[RequestTrace | None] = [None] * len(measured)
        tasks: list[asyncio.Task] = []
        self.start = time.perf_counter()
        issuing_ends = config.duration if config.duration is not None else float("inf")
        hard_end = issuing_ends + config.grace

        async def one(index: int) -> None:
            if self.now() < issuing_ends:
                request = self.request(index, measured[index])
                traces[index] = RequestTrace(index, prompt_id=measured[index].id)
                await self.send(backend, request, traces[index])

        try:
            if config.concurrency is not None:
                counter = itertools.count()

                async def worker() -> None:
                    while (index := next(counter)) < len(measured) and self.now() < issuing_ends:
                        await one(index)

                tasks += [asyncio.create_task(worker()) for _ in range(config.concurrency)]
            else:
                await self.issue(one, len(measured), issuing_ends, tasks)
            if tasks:
                _, pending = await asyncio.wait(tasks, timeout=max(0.0, hard_end - self.now())
                                                if config.duration is not None else None)
                await _cancel(pending)
        except asyncio.CancelledError:
            # Interrupted (Ctrl-C): what was in flight is cancelled on the wire and recorded so, and the run so far
            # kept for the caller to write, before the cancellation goes on.
            await _cancel(tasks)
            self.partial = self.trace_of(traces, len(measured), interrupted=True)
            raise
        return self.trace_of(traces, len(measured))

    def trace_of(self, traces: list[RequestTrace | None], planned: int, interrupted: bool = False) -> RunTrace:
        """The RunTrace of the requests sent so far (those never sent leave no record and count as not sent)."""
        duration = self.now()
        records = [trace for trace in traces if trace is not None]
        for trace in records:
            if trace.status == IN_FLIGHT:  # defensive: send() marks a cancelled request before re-raising
                trace.status, trace.end = CANCELLED, trace.end or duration
        config = self.config.to_json() | {"run_id": self.run_id, "server": self.server}
        return RunTrace(requests=records, duration=duration, planned=planned,
                        config=config | ({"interrupted": True} if interrupted else {}))

    async def issue(self, one, count: int, issuing_ends: float, tasks: list[asyncio.Task]) -> None:
        """Rate mode: start request i at its arrival offset, behind a semaphore when max_concurrency is set; the
        tasks go into `tasks` as they start, so that an interruption here can cancel those already running."""
        config = self.config
        offsets = ArrivalProcess(config.rate, config.burstiness, config.seed).offsets(count)
        slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None

        async def gated(index: int) -> None:
            async with slots:
                await one(index)

        for index, offset in enumerate(offsets):
            if offset >= issuing_ends:
                break
            if (delay := offset - self.now()) > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(gated(index) if slots else one(index)))


async def _cancel(tasks: Iterable[asyncio.Task]) -> None:
    """Cancel the tasks not done yet and wait for them to record their requests as cancelled."""
    pending = [task for task in tasks if not task.done()]
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


def _record_final(trace: RequestTrace, final: Final) -> None:
    trace.status = OK
    trace.prompt_tokens, trace.completion_tokens = final.prompt_tokens, final.completion_tokens
    trace.finish_reason = final.finish_reason
    trace.rounds, trace.drafted, trace.accepted = final.rounds, final.drafted, final.accepted
    trace.fallback_rounds, trace.draft_failures = final.fallback_rounds, final.draft_failures


async def run_level(config: RunConfig, prompts: list[Prompt] | None = None) -> RunTrace:
    return await Driver(config, prompts).run()

