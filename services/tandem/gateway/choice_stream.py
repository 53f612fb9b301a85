"""One choice of a request, run: the per-choice half of Generations (gateway.generation).

A choice is placed on an arm (the arm router's placement, when one runs), submitted to that arm's serving loop, and
its engine updates turned into events: text detokenized incrementally, tool calls parsed out of it, the output cut
after the one call a request allowed. Its outcome (tokens, timings, or a failure) is told to the arm router.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from tandem.core.detok import IncrementalDetokenizer
from tandem.core.stops import FINISH_ABORT, FINISH_STOP
from tandem.engines import Backend
from tandem.errors import BackendUnavailable, InvalidArgument
from tandem.gateway.arms import ArmOutcome, ArmRoute, ArmRouter
from tandem.gateway.events import FAILURES, ChoiceDelta, ChoiceEnd, EngineFailed, EngineUnavailable, Event, error_code
from tandem.gateway.handles import Finished, Submission
from tandem.gateway.lanes import ServingLoop
from tandem.gateway.tools import FINISH_TOOL_CALLS, ToolCallParser
from tandem.gateway.validate import PreparedRequest
from tandem.telemetry.gateway import RequestObserver

log = logging.getLogger(__name__)


class ChoiceStream:
    """Generations' per-choice methods; Generations sets the serving loops (by arm) and the arm router."""

    loops: dict[str, ServingLoop]
    arm_router: ArmRouter | None

    async def _choice(self, index: int, prepared: PreparedRequest, request_id: str, observed: RequestObserver,
                      backend: Backend, loop: ServingLoop, tenant: str = "",
                      admitted: asyncio.Event | None = None) -> AsyncIterator[Event]:
        """One choice's events; `prepared` is the choice's own (choice_request), `request_id` the client's request."""
        try:
            observed.prepared(prepared)
            route, loop = self._route(prepared, loop, observed, tenant)
            try:
                handle = await loop.submit(Submission(
                    prepared.prompt_ids, prepared.params, prepared.request_id, prepared.session_id, prepared.max_k,
                    trace=observed.span, cache_scope=tenant, priority=prepared.priority,
                    prediction=prepared.prediction))
            except FAILURES as exc:
                observed.failed(error_code(exc), str(exc))
                raise
            if admitted is not None:
                admitted.set()
            detok = IncrementalDetokenizer(backend.engine.decode, prepared.params.stop)
            # A forced call's start is in the prompt already: the output goes on from inside the call.
            calls = ToolCallParser(prepared.tool_names, prepared.single_tool_call, prepared.call_start) \
                if prepared.tool_names else None
            finished: Finished | None = None
            token_ids: list[int] = []
            first_token_at: float | None = None
            delivered = False  # a delta has gone out (the first carries the prompt's ids)
            cut_at_call = False  # the first call ended the output (single_tool_call): the request was stopped
            try:
                async for update in handle:
                    finished = update.finished
                    if route is not None and update.token_ids:
                        token_ids.extend(update.token_ids)
                        if first_token_at is None:
                            first_token_at = time.monotonic()
                    observed.tokens(len(update.token_ids))
                    text = detok.push(update.token_ids, final=finished is not None,
                                      cut=finished.text_cut if finished else None)
                    runs = [(text, [])]
                    if calls is not None:
                        runs = calls.runs(text, final=finished is not None) or [("", [])]
                        if calls.ended and not any(made for _, made in runs):
                            continue  # after the one call: nothing more goes out
                        if calls.ended and finished is None:
                            cut_at_call = loop.cancel(handle.request_id)  # its last update then says "abort"
                    (text, made), *after = runs
                    if text or made or update.token_ids or update.prompt_logprobs is not None:
                        yield ChoiceDelta(index, text, update.token_ids, update.logprobs, tuple(made),
                                          update.prompt_logprobs, None if delivered else list(prepared.prompt_ids))
                        delivered = True
                    for text, made in after:  # text after a call: a delta of its own, so it comes after the call
                        yield ChoiceDelta(index, text, [], None, tuple(made))
            except (InvalidArgument, EngineUnavailable, EngineFailed, BackendUnavailable) as exc:
                # An engine failure or stall counts against the arm; a shutdown (draining) does not.
                if route is not None and not isinstance(exc, InvalidArgument) \
                        and (isinstance(exc, EngineFailed) or not loop.draining):
                    self._tell(route, ArmOutcome(failed=True))
                observed.failed(error_code(exc), str(exc))
                raise
            finally:
                if finished is None:
                    # The client went away (cancelled, deadline) or the engine failed: free the request's caches.
                    loop.cancel(handle.request_id, detach=True)
            if cut_at_call and finished.finish_reason == FINISH_ABORT:
                finished = replace(finished, finish_reason=FINISH_STOP)
            observed.completed(handle.prompt_tokens, finished.completion_tokens, finished.finish_reason,
                               finished.stats)
            if route is not None:
                self._record(route, prepared, finished, first_token_at, token_ids)
            # OpenAI's reason for an output that ends in calls; one cut by max_tokens stays "length".
            reason = FINISH_TOOL_CALLS if calls is not None and calls.called and finished.finish_reason == FINISH_STOP \
                else finished.finish_reason
            yield ChoiceEnd(index, reason, handle.prompt_tokens, finished.completion_tokens, finished.stats, request_id)
        finally:
            observed.end()  # a no-op unless the client went away (cancelled, deadline) mid-stream

    def _route(self, prepared: PreparedRequest, loop: ServingLoop, observed: RequestObserver,
               tenant: str = "") -> tuple[ArmRoute | None, ServingLoop]:
        """The arm router's placement (None without a router) and the loop that serves the request. The tenant keys
        the placement (the same session id in two tenants is placed independently)."""
        if self.arm_router is None:
            return None, loop
        route = self.arm_router.route(prepared.session_id, prepared.request_id, tenant)
        if route is None:
            return None, loop
        arm_loop = self.loops.get(route.arm)
        if arm_loop is None:  # not served here: the baseline, unrecorded
            return None, loop
        if observed.span is not None:
            observed.span.set_attribute("tandem.canary.arm", route.arm)
        return route, arm_loop

    def _record(self, route: ArmRoute, prepared: PreparedRequest, finished: Finished, first_token_at: float | None,
                token_ids: list[int]) -> None:
        self._tell(route, ArmOutcome(prompt_ids=prepared.prompt_ids, token_ids=token_ids,
                                     greedy=prepared.params.greedy, completion_tokens=finished.completion_tokens,
                                     stats=finished.stats, first_token_at=first_token_at,
                                     finished_at=time.monotonic()))

    def _tell(self, route: ArmRoute, outcome: ArmOutcome) -> None:
        try:
            self.arm_router.record(route, outcome)
        except Exception:  # an arm router never fails a request
            log.exception("arm router: recording a request failed")
