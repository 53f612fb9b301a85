"""EngineLoop: drives a (not thread-safe) engine (core.serving_engine) from one background thread for an asyncio server.

Adds and aborts go through a command queue drained between steps; each step's outputs return to the event loop
in one call_soon_threadsafe and fan out to per-request asyncio queues. A step that raises or stalls fails the
affected requests instead of leaving their streams hanging. This module is the event loop's side; the engine
thread's (stepping, applying commands, publishing outputs) is gateway.engine_thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

from tandem.core.config import TARGET_TOKEN_ALLOWANCE_S
from tandem.core.policy import PolicyState
from tandem.core.requests import Sequence
from tandem.core.serving_engine import ServingEngine
from tandem.errors import InvalidArgument, request_id_in_use
from tandem.gateway.engine_thread import EngineThread, _Add
from tandem.gateway.events import EngineUnavailable
from tandem.gateway.handles import Delivery, RequestHandle, SessionStore, Submission, check_room
from tandem.gateway.options import GatewayOptions
from tandem.sessions import MemorySessionStore
from tandem.telemetry.metrics import GatewayMetrics
from tandem.telemetry.rounds import RoundTracer

log = logging.getLogger(__name__)

UNREAD_TIMEOUT_S = 60.0  # a finished request whose client reads nothing for this long loses its output (unread)


class EngineLoop(EngineThread):
    def __init__(self, engine: ServingEngine, max_requests: int = GatewayOptions().max_requests,
                 stall_timeout: float = GatewayOptions().stall_timeout,
                 sessions: SessionStore | None = None, metrics: GatewayMetrics | None = None,
                 thread_name: str = "tandem-engine", settle: bool = False) -> None:
        """metrics: counts each finished request's rounds (None: off); thread_name: the engine thread's; settle: after
        a step, wait (up to SETTLE_MAX_S) until the event loop has run what its outputs woke, before the next step.
        For an engine whose forwards fill this process's CPUs: the loop's wake-ups and writes then take a core from
        a forward's threads mid-step, and a parallel region waits for its slowest thread (served at 8 in flight on 2
        cores: 1.01-1.07x the tokens per second with it, level at one in flight; docs/performance.md); elsewhere it
        would only add the loop's work to each step."""
        if max_requests < 1:
            raise InvalidArgument(f"max_requests: must be at least 1, got {max_requests}")
        self.engine = engine
        self.max_requests = max_requests
        self.stall_timeout = stall_timeout
        self.sessions: SessionStore = sessions if sessions is not None else MemorySessionStore()
        self.draining = False
        # No target replica answered the last step: new requests are refused until one does (the gateway's
        # readiness is NOT_SERVING meanwhile, and it probes the replicas: `recover`).
        self.unavailable = False
        self._active: dict[str, RequestHandle] = {}  # touched only on the event loop
        # Finished in the engine, their output not yet all read by their clients: each still holds a queue place, so
        # clients that stop reading cannot pile up output past the queue's bound (weak: a client gone frees it).
        self._unread: weakref.WeakSet[RequestHandle] = weakref.WeakSet()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._running: dict[str, tuple[Sequence, RequestHandle]] = {}  # touched only on the engine thread
        self._step_started: float | None = None
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._watchdog: asyncio.Task | None = None
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-sessions")
        self.thread_name = thread_name
        self.metrics = metrics
        self.settle = settle
        self._rounds = RoundTracer()  # touched only on the engine thread
        for side in (engine.drafter, engine.verifier):
            if side is not None:  # remote pools pass each traced row's context to its worker
                side.carry_trace(self._rounds.carriers)

    async def start(self) -> None:
        self._event_loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()
        self._watchdog = asyncio.create_task(self._watch_stalls())

    def end_requests(self) -> None:
        """Fail every request in flight as the server shuts down: each client is told so (a gRPC status, an HTTP
        stream's error event) while its connection is still open."""
        for request_id in list(self._active):
            self._fail(request_id, EngineUnavailable("server shutting down"))

    async def close(self) -> None:
        self._closed.set()
        if self._watchdog is not None:
            self._watchdog.cancel()
        self.end_requests()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, self.stall_timeout)
        self._saver.shutdown(wait=True)

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def batch_capacity(self) -> int:
        """Sequences one step runs; requests beyond it wait in the queue."""
        return self.engine.max_batch

    def has_request(self, request_id: str) -> bool:
        return request_id in self._active

    def probe_idle(self, timeout_s: float) -> None:
        """While no request runs here, probe the target replicas (blocking; keep it off the event loop): unavailable
        when none answers. A step finds dead replicas only when one runs: without the probe, replicas gone between
        requests (shared pools stopped, another gateway's traffic seeing them die) would leave readiness SERVING until
        a request failed."""
        if not self.unavailable and not self.active and not self.engine.verifier.reachable(timeout_s):
            self.unavailable = True

    def recover(self, timeout_s: float) -> bool:
        """Probe the target replicas (blocking; keep it off the event loop): serve again once one answers, no step
        is stalled and none waits for a replica to come back."""
        if self.unavailable and self.engine.verifier.reachable(timeout_s):
            self.unavailable = False
        return not self.unavailable and not self.stalled and not self.waiting_for_replica

    @property
    def waiting_for_replica(self) -> bool:
        """A step waits for a target replica to come back (every one failed): new requests are refused meanwhile,
        as while none is available, rather than queued behind a wait that may end in failure."""
        return self.engine.verifier.waiting_for_worker()

    def preemptions(self) -> dict[str, int]:
        """Sequences the engine took out of a step it ran them in, by kind (core.engine; read by the metrics scrape
        thread: the engine keeps fixed keys)."""
        return dict(self.engine.preemptions)

    def sessions_in_fallback(self) -> int:
        """Running requests whose policy is in plain-decoding fallback (read by the metrics scrape thread)."""
        return sum(seq.policy.fallback for seq, _ in list(self._running.values()))

    @property
    def stalled(self) -> bool:
        return (started := self._step_started) is not None and time.monotonic() - started > self.step_deadline_s

    @property
    def step_deadline_s(self) -> float:
        """How long the running step may take: the stall timeout, plus an allowance per token its forward computes
        (a long prompt prefilled whole, or scored for its logprobs, is a long step, not a hung engine)."""
        return self.stall_timeout + TARGET_TOKEN_ALLOWANCE_S * self.engine.step_tokens

    async def submit(self, request: Submission) -> RequestHandle:
        request_id, session_id = request.request_id, request.session_id
        if self._thread is None or self._closed.is_set() or self.draining:
            raise EngineUnavailable("not accepting requests: the server is draining or stopped")
        if self.stalled:
            raise EngineUnavailable("not accepting requests: the engine is stalled")
        if self.unavailable or self.waiting_for_replica:
            raise EngineUnavailable("not accepting requests: no target replica is available (readiness turns "
                                    "SERVING once one answers)")
        if request_id in self._active:
            raise request_id_in_use(request_id)
        check_room(self.active, self.unread, self.max_requests)
        handle = RequestHandle(request_id, len(request.prompt), session_id, trace=request.trace)
        self._active[request_id] = handle
        state, affinity = None, {}
        if session_id:
            try:
                state, affinity = await self._load_session(session_id)
            except asyncio.CancelledError:
                self._active.pop(request_id, None)
                raise
            if self._active.get(request_id) is not handle:
                return handle  # detached while the session state loaded
        self._commands.put(_Add(handle, request, state, affinity))
        return handle

    def cancel(self, request_id: str, detach: bool = False) -> bool:
        """Abort a queued or running request, freeing its caches (False if not active); detach: deliver no more."""
        handle = self._active.pop(request_id, None) if detach else self._active.get(request_id)
        if handle is None:
            return False
        handle.abort_requested = True
        self._commands.put(handle)
        return True

    async def _load_session(self, session_id: str) -> tuple[PolicyState | None, dict]:
        try:
            data = await asyncio.to_thread(self.sessions.get, session_id)
            return (PolicyState.from_dict(data), data) if data else (None, {})
        except Exception:
            log.warning("could not load state for session %r; starting fresh", session_id, exc_info=True)
            return None, {}

    def _deliver(self, updates: list[Delivery], settled: threading.Event | None = None) -> None:
        if settled is not None:  # after the handlers these updates wake, and one turn of what they start
            loop = asyncio.get_running_loop()
            loop.call_soon(loop.call_soon, settled.set)
        for handle, update in updates:
            # Identity, not id: a detached request's id may already belong to a new request.
            if self._active.get(handle.request_id) is not handle:
                continue
            handle.updates.put_nowait(update)
            if isinstance(update, Exception) or update.finished is not None:
                del self._active[handle.request_id]
                handle.unread_since = time.monotonic()
                self._unread.add(handle)

    @property
    def unread(self) -> int:
        """Requests the engine finished whose clients have not read all their output (each holds a queue place). One
        whose client has read nothing for UNREAD_TIMEOUT_S loses its output and its place: a client that stops
        reading would hold them for as long as it kept its connection open."""
        now = time.monotonic()
        for handle in list(self._unread):
            if handle.updates.empty():  # read to the end since
                self._unread.discard(handle)
            elif now - handle.unread_since > UNREAD_TIMEOUT_S:
                self._unread.discard(handle)
                while not handle.updates.empty():
                    handle.updates.get_nowait()
                handle.updates.put_nowait(EngineUnavailable(f"output dropped: its client read none of it for "
                                                            f"{UNREAD_TIMEOUT_S:.0f} s"))
                log.warning("request %s: output dropped, its client read none of it for %.0f s", handle.request_id,
                            UNREAD_TIMEOUT_S)
        return len(self._unread)

    def _fail(self, request_id: str, error: Exception) -> None:
        if (handle := self._active.pop(request_id, None)) is not None:
            handle.updates.put_nowait(error)
            self._commands.put(handle)

    async def _watch_stalls(self) -> None:
        interval = max(0.05, min(1.0, self.stall_timeout / 4))
        while not self._closed.is_set():
            await asyncio.sleep(interval)
            if self.stalled and self._active:
                message = f"engine stalled: a step ran over {self.step_deadline_s:.0f}s"
                log.error("%s; failing %d requests", message, len(self._active))
                for request_id in list(self._active):
                    self._fail(request_id, EngineUnavailable(message))
