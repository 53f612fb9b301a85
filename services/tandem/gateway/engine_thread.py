"""The engine thread's half of EngineLoop (gateway.loop): everything that runs on the one thread that drives the engine.

It drains the command queue (adds and aborts) between steps, runs each step, turns its outputs into per-request
updates, fails the requests a step could not serve, and hands the updates to the event loop in one
call_soon_threadsafe (EngineLoop._deliver fans them out there). State it touches only on this thread: `_running`,
`_rounds`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tandem.core.policy import PolicyState
from tandem.core.requests import Sequence, StepOutput
from tandem.core.serving_engine import ServingEngine
from tandem.core.stops import FINISH_ABORT
from tandem.errors import BackendUnavailable, RequestRefused, TandemError
from tandem.gateway.events import EngineFailed, EngineUnavailable
from tandem.gateway.handles import Delivery, Finished, RequestHandle, SessionStore, Submission, Update
from tandem.telemetry.metrics import GatewayMetrics
from tandem.telemetry.rounds import RoundTracer

log = logging.getLogger(__name__)

IDLE_POLL_SECONDS = 0.25
SETTLE_MAX_S = 0.05  # a busy event loop holds a settling engine back no longer than this a step


@dataclass(slots=True, frozen=True)
class _Add:
    handle: RequestHandle
    request: Submission
    policy: PolicyState | None
    affinity: dict


class EngineThread:
    """EngineLoop's engine-thread methods; EngineLoop sets the state below and defines `_deliver` (event loop)."""

    engine: ServingEngine
    sessions: SessionStore
    metrics: GatewayMetrics | None
    settle: bool
    unavailable: bool
    _commands: queue.SimpleQueue
    _running: dict[str, tuple[Sequence, RequestHandle]]
    _rounds: RoundTracer
    _step_started: float | None
    _closed: threading.Event
    _event_loop: asyncio.AbstractEventLoop | None
    _saver: ThreadPoolExecutor

    def _run(self) -> None:
        while not self._closed.is_set():
            if not self._drain_commands(block=not self.engine.has_unfinished()):
                continue
            self._step_started = time.monotonic()
            if self._rounds.active:
                self._rounds.before_step()
            try:
                outputs = self.engine.step()
            except RequestRefused as exc:  # that request alone cannot go on; the others run again without it
                if exc.request_id in self._running:
                    self._fail_one(exc.request_id, exc)
                else:  # naming none of them, it would be raised again at every step
                    log.error("a refusal named no running request (%s): failing the step's requests", exc.request_id)
                    self._fail_running(exc)
                continue
            except BackendUnavailable as exc:
                log.warning("no target replica available: failing %d request(s) UNAVAILABLE", len(self._running))
                self.unavailable = True
                self._fail_running(exc)
                continue
            except Exception as exc:
                log.exception("engine step failed")
                self._fail_running(exc)
                continue
            finally:
                self._step_started = None
            self.unavailable = False
            settled = self._publish([self._update_for(out) for out in outputs], settle=self.settle)
            if settled is not None and self.engine.has_unfinished():
                settled.wait(SETTLE_MAX_S)
        self._fail_running(EngineUnavailable("server shutting down"))

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued adds and cancels; True when the engine has work to step."""
        updates: list[Delivery] = []
        try:
            command = self._commands.get(timeout=IDLE_POLL_SECONDS) if block else self._commands.get_nowait()
            while True:
                updates.extend(self._apply(command))
                command = self._commands.get_nowait()
        except queue.Empty:
            pass
        self._publish(updates)
        return self.engine.has_unfinished()

    def _apply(self, command: _Add | RequestHandle) -> list[Delivery]:
        """Add a request, or abort one (a command that is just its handle)."""
        if isinstance(command, RequestHandle):
            if self._running.get(command.request_id, (None, None))[1] is not command:
                return []
            self.engine.abort(command.request_id)
            return [self._update_for(StepOutput(command.request_id, [], FINISH_ABORT))]
        handle = command.handle
        try:
            if handle.session_id:
                self.engine.pin_session(handle.session_id, command.affinity)
            request = command.request
            self.engine.add_request(list(request.prompt), request.params, handle.request_id, command.policy,
                                    request.max_k, session_id=handle.session_id, cache_scope=request.cache_scope,
                                    priority=request.priority, prediction=list(request.prediction))
        except Exception as exc:
            return [(handle, exc if isinstance(exc, TandemError) else EngineFailed(f"add failed: {exc}"))]
        self._running[handle.request_id] = (self.engine.sequence(handle.request_id), handle)
        if handle.trace is not None:
            self._rounds.add(handle.request_id, handle.trace, self.engine.sequence(handle.request_id))
        # An abort that arrived while the session state loaded was queued before this add.
        return self._apply(handle) if handle.abort_requested else []

    def _update_for(self, out: StepOutput) -> Delivery:
        seq, handle = self._running[out.request_id]
        logprobs = out.logprobs
        if logprobs is None and seq.params.logprobs is not None:
            logprobs = []  # an abort's StepOutput carries no tokens and no logprobs: still a list for such a request
        if handle.trace is not None:
            self._rounds.on_output(out.request_id, len(out.new_token_ids), out.finish_reason)
        if out.finish_reason is None:
            return handle, Update(out.new_token_ids, logprobs=logprobs, prompt_logprobs=out.prompt_logprobs)
        del self._running[out.request_id]
        if self.metrics is not None:
            self.metrics.record_request(seq)
        result = self.engine.result(seq)
        if handle.session_id:
            with contextlib.suppress(RuntimeError):  # the saver is already shut down: the loop is closing
                state = seq.policy.to_dict() | self.engine.session_affinity(handle.session_id)
                self._saver.submit(self._save_session, handle.session_id, state)
        finished = Finished(result.finish_reason, seq.text_cut, len(result.token_ids), result.stats)
        return handle, Update(out.new_token_ids, finished, logprobs, out.prompt_logprobs)

    def _save_session(self, session_id: str, state: dict) -> None:
        try:
            self.sessions.put(session_id, state)
        except Exception:
            log.warning("could not save state for session %r", session_id, exc_info=True)

    def _fail_one(self, request_id: str, error: TandemError) -> None:
        self.engine.abort(request_id)
        self._rounds.forget(request_id, error)
        entry = self._running.pop(request_id, None)
        if entry is not None:
            self._publish([(entry[1], error)])

    def _fail_running(self, error: Exception) -> None:
        reason = error if isinstance(error, TandemError) else EngineFailed(f"engine step failed: {error}")
        failed, self._running = [handle for _, handle in self._running.values()], {}
        self._rounds.fail_all(reason)
        for handle in failed:
            try:
                self.engine.abort(handle.request_id)
            except Exception:
                log.exception("could not release %s after a failure", handle.request_id)
        self._publish([(handle, reason) for handle in failed])

    def _publish(self, updates: list[Delivery], settle: bool = False) -> threading.Event | None:
        """Hand `updates` to the event loop; settle: an Event set once the loop has run what they woke (None when
        nothing was handed over)."""
        if updates and self._event_loop is not None:
            settled = threading.Event() if settle else None
            with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is listening any more
                self._event_loop.call_soon_threadsafe(self._deliver, updates, settled)
                return settled
        return None
