"""Generations: what a gateway does with one generate request, whatever the transport (gRPC or OpenAI HTTP).

A request is validated and tokenized (off the event loop: a long prompt must not stall other streams), routed to a
canary arm when one runs, submitted to the engine loop once per choice (`n`), and streamed back as events:
`ChoiceDelta` (new text and tokens of one choice) and, as each choice's last event, `ChoiceEnd`. Closing the stream
early (the client went away) cancels every choice and frees its caches on every worker. Failures are raised as the
gateway's typed errors; each transport maps them to its own status codes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, replace

from tandem.core.detok import IncrementalDetokenizer
from tandem.core.engine import SpeculativeEngine
from tandem.core.logprobs import TokenLogprob
from tandem.errors import BackendUnavailable, InvalidArgument
from tandem.gateway.lanes import ServingLoop
from tandem.gateway.loop import EngineFailed, EngineUnavailable, Finished, QueueFull
from tandem.gateway.validate import (
    GatewayLimits,
    ModelLimits,
    PreparedRequest,
    chat_ids,
    display_name,
    encode_prompt,
    prepare,
)
from tandem.telemetry.gateway import RequestObserver
from tandem.telemetry.metrics import GatewayMetrics
from tandem.v1 import generation_pb2 as pb

log = logging.getLogger(__name__)

SEED_STRIDE = 0x9E3779B97F4A7C15  # choice i > 0 of a seeded request samples with a seed derived from the client's


@dataclass(slots=True)
class Backend:
    """A loaded engine and what the gateway needs to describe and feed it. `lanes`: more engines over the same
    pools (gateway.lanes), each driven by its own loop; `engine` is the first lane."""

    engine: SpeculativeEngine
    tokenizer: object
    target_name: str
    draft_name: str = ""
    lanes: tuple[SpeculativeEngine, ...] = ()

    def __post_init__(self) -> None:
        # Model info, /v1/models and metric labels name a model given as a path by its directory's name only.
        self.target_name, self.draft_name = display_name(self.target_name), display_name(self.draft_name)

    @property
    def engines(self) -> list[SpeculativeEngine]:
        return [self.engine, *self.lanes]

    @property
    def model_limits(self) -> ModelLimits:
        spec = self.engine.config.spec
        return ModelLimits(vocab_size=self.engine.verifier.vocab_size,
                           max_k=spec.k_max if self.engine.speculating else 0,
                           context_window=self.engine.verifier.context_window)


@dataclass(slots=True, frozen=True)
class ChoiceDelta:
    """New tokens of one choice: text never splits a character or shows a stop string."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for logprobs


@dataclass(slots=True, frozen=True)
class ChoiceEnd:
    """The last event of one choice."""

    index: int
    finish_reason: str  # tandem.core.stops FINISH_*: "stop", "length" or "abort"
    prompt_tokens: int
    completion_tokens: int
    stats: dict  # speculation: rounds, drafted, accepted, acceptance_rate, mean_accepted_length, fallback_rounds, ...
    request_id: str


Event = ChoiceDelta | ChoiceEnd

# The gateway's failures by kind, named as gRPC status codes (the names telemetry records as error.type); each
# transport maps a name to its own status.
ERROR_CODES: dict[type[Exception], str] = {
    InvalidArgument: "INVALID_ARGUMENT",
    QueueFull: "RESOURCE_EXHAUSTED",
    EngineUnavailable: "UNAVAILABLE",
    BackendUnavailable: "UNAVAILABLE",
    EngineFailed: "INTERNAL",
}
FAILURES = tuple(ERROR_CODES)


class TenantBusy(QueueFull):
    """The tenant already holds its limit of requests in flight: its key's max_concurrency, or its share of the
    gateway's queue (RESOURCE_EXHAUSTED / 429, as a full queue)."""


def scoped_id(tenant: str, id_: str) -> str:
    """An id inside the gateway: the tenant's namespace in front (tenant names hold no ':'), so one tenant's request
    and session ids never reach another's requests, session state or retained KV caches."""
    return f"{tenant}:{id_}" if tenant and id_ else id_


def error_code(exc: Exception) -> str:
    return next(code for kind, code in ERROR_CODES.items() if isinstance(exc, kind))


def choice_ids(request_id: str, n: int) -> list[str]:
    """Engine request ids of a request's choices: the request's own id when n is 1."""
    return [request_id] if n == 1 else [f"{request_id}/{index}" for index in range(n)]


def choice_request(prepared: PreparedRequest, index: int) -> PreparedRequest:
    """Choice `index` of a request: its own engine id, its own seed (the same seed would repeat choice 0 token for
    token), and the session only on choice 0 (one session's cache serves one sequence at a time)."""
    if prepared.n == 1:
        return prepared
    params = prepared.params
    if index and params.seed is not None:
        params = replace(params, seed=(params.seed + index * SEED_STRIDE) % 2**63)
    return replace(prepared, request_id=choice_ids(prepared.request_id, prepared.n)[index], params=params,
                   session_id=prepared.session_id if index == 0 else "")


class Generations:
    """The gateway's generate path; `attach` makes it ready (before that, every call raises EngineUnavailable)."""

    def __init__(self, limits: GatewayLimits | None = None, metrics: GatewayMetrics | None = None) -> None:
        self.limits = limits or GatewayLimits()
        self.metrics = metrics
        self.backend: Backend | None = None
        self.loop: ServingLoop | None = None
        self.model_limits: ModelLimits | None = None
        self.loops: dict[str, ServingLoop] = {}  # canary arms: arm name -> loop; `loop` is the baseline arm's
        self.canary = None  # tandem.canary.CanaryController, or None: every request on `loop`
        self._choices: dict[str, list[str]] = {}  # scoped request id -> its choices' engine ids, while n > 1 runs
        self.tenant_limits: dict[str, int] = {}  # tenant -> most requests in flight at once (absent: no cap)
        # The most of the queue (max_requests) one named tenant may hold, so one client cannot fill it for the rest;
        # 1.0: no share cap. Requests without a tenant (no API keys) are one caller and take the whole queue.
        self.tenant_queue_share = 1.0
        self._tenant_active: dict[str, int] = {}  # tenant -> requests in flight, for the tenants with a cap

    def attach(self, backend: Backend, loop: ServingLoop, loops: Mapping[str, ServingLoop] | None = None,
               canary=None) -> None:
        """Start serving. With canary arms, `backend` and `loop` are the baseline arm's (unknown arms fall back to
        it; model info describes it), `loops` every arm's."""
        self.model_limits = backend.model_limits
        self.loops = dict(loops) if loops else {}
        self.canary = canary
        self.backend, self.loop = backend, loop

    @property
    def ready(self) -> bool:
        return self.backend is not None and self.loop is not None and not self.loop.draining

    @property
    def tokenizer(self):
        return self._serving()[0].tokenizer

    @property
    def target_name(self) -> str:
        return self._serving()[0].target_name

    def _serving(self) -> tuple[Backend, ServingLoop]:
        if self.backend is None or self.loop is None:
            raise EngineUnavailable("not ready: the engine is still loading")
        if self.loop.draining:
            raise EngineUnavailable("draining: this server is shutting down")
        return self.backend, self.loop

    async def prepare(self, request: pb.GenerateRequest) -> PreparedRequest:
        """Validate and tokenize in a worker thread; raises InvalidArgument naming the field."""
        backend, _ = self._serving()
        return await asyncio.to_thread(prepare, request, backend.tokenizer, self.limits, self.model_limits)

    async def tokenize(self, prompt: str | None = None, chat: pb.Chat | None = None, tenant: str = "") -> list[int]:
        """The token ids of a prompt (no template) or a chat (template applied), in a worker thread. `tenant` is
        taken for symmetry with stream/abort: tokenizing touches no per-tenant state."""
        backend, _ = self._serving()
        if chat is not None:
            return await asyncio.to_thread(chat_ids, chat, backend.tokenizer, self.limits)
        if not prompt:
            raise InvalidArgument("input: set one of prompt or chat")
        return await asyncio.to_thread(encode_prompt, prompt, backend.tokenizer, self.limits)

    async def stream(self, request: pb.GenerateRequest, metadata: Sequence = (),
                     tenant: str = "") -> AsyncIterator[Event]:
        """Every choice's events, interleaved as they come; a choice's ChoiceEnd is its last event. `tenant`: the
        authenticated caller's (the transport's to say; "" without API keys), which namespaces its ids."""
        _, loop = self._serving()
        cap = self.tenant_cap(tenant, loop.max_requests)
        if cap is None:
            async for event in self._stream(request, metadata, tenant):
                yield event
            return
        active = self._tenant_active.get(tenant, 0)
        if active >= cap:
            raise TenantBusy(f"tenant {tenant!r} has {active} requests queued or running (its limit is {cap}); "
                             "retry later")
        self._tenant_active[tenant] = active + 1
        try:
            async for event in self._stream(request, metadata, tenant):
                yield event
        finally:
            if (left := self._tenant_active[tenant] - 1) > 0:
                self._tenant_active[tenant] = left
            else:
                del self._tenant_active[tenant]

    def tenant_cap(self, tenant: str, max_requests: int) -> int | None:
        """The most requests `tenant` may have queued or running: the lower of its key's max_concurrency and its
        share of a queue of `max_requests`; None for no cap. A request with n choices counts once: its choices
        share its slot here, while the engine's queue counts each."""
        if not tenant:
            return None
        cap = self.tenant_limits.get(tenant)
        if self.tenant_queue_share < 1.0:
            share = max(1, int(max_requests * self.tenant_queue_share))
            cap = share if cap is None else min(cap, share)
        return cap

    async def _stream(self, request: pb.GenerateRequest, metadata: Sequence, tenant: str) -> AsyncIterator[Event]:
        backend, loop = self._serving()
        observed = RequestObserver(self.metrics, request, metadata, backend.target_name)
        try:
            prepared = await self.prepare(request)
        except InvalidArgument as exc:
            observed.failed(error_code(exc), str(exc))
            raise
        client_id = prepared.request_id  # what the client sees back; the engine sees the scoped one
        prepared = replace(prepared, request_id=scoped_id(tenant, prepared.request_id),
                           session_id=scoped_id(tenant, prepared.session_id))
        choices = [choice_request(prepared, index) for index in range(prepared.n)]
        if len(choices) == 1:
            async for event in self._choice(0, choices[0], client_id, observed, backend, loop, tenant):
                yield event
            return
        self._choices[prepared.request_id] = [choice.request_id for choice in choices]
        events: asyncio.Queue = asyncio.Queue()

        async def run(index: int, choice: PreparedRequest) -> None:
            # Each choice is a generation of its own to telemetry: its own span and duration.
            choice_observed = observed if index == 0 else RequestObserver(self.metrics, request, metadata,
                                                                          backend.target_name)
            try:
                async for event in self._choice(index, choice, client_id, choice_observed, backend, loop, tenant):
                    events.put_nowait(event)
            except Exception as exc:
                events.put_nowait(exc)

        tasks = [asyncio.create_task(run(index, choice)) for index, choice in enumerate(choices)]
        try:
            ended = 0
            while ended < len(tasks):
                event = await events.get()
                if isinstance(event, Exception):
                    raise event
                ended += isinstance(event, ChoiceEnd)
                yield event
        finally:
            # A failed choice or a client gone: stop the others (each frees its caches as it unwinds).
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._choices.pop(prepared.request_id, None)

    async def _choice(self, index: int, prepared: PreparedRequest, request_id: str, observed: RequestObserver,
                      backend: Backend, loop: ServingLoop, tenant: str = "") -> AsyncIterator[Event]:
        """One choice's events; `prepared` is the choice's own (choice_request), `request_id` the client's request."""
        try:
            observed.prepared(prepared)
            assignment, loop = self._route(prepared, loop, observed, tenant)
            try:
                handle = await loop.submit(prepared.prompt_ids, prepared.params, prepared.request_id,
                                           prepared.session_id, prepared.max_k, trace=observed.span)
            except FAILURES as exc:
                observed.failed(error_code(exc), str(exc))
                raise
            detok = IncrementalDetokenizer(backend.engine.decode, prepared.params.stop)
            finished: Finished | None = None
            token_ids: list[int] = []
            first_token_at: float | None = None
            try:
                async for update in handle:
                    finished = update.finished
                    if assignment is not None and update.token_ids:
                        token_ids.extend(update.token_ids)
                        if first_token_at is None:
                            first_token_at = time.monotonic()
                    observed.tokens(len(update.token_ids))
                    text = detok.push(update.token_ids, final=finished is not None,
                                      cut=finished.text_cut if finished else None)
                    if text or update.token_ids:
                        yield ChoiceDelta(index, text, update.token_ids, update.logprobs)
            except (InvalidArgument, EngineUnavailable, EngineFailed, BackendUnavailable) as exc:
                # An engine failure or stall counts against the canary arm; a shutdown (draining) does not.
                if assignment is not None and not isinstance(exc, InvalidArgument) \
                        and (isinstance(exc, EngineFailed) or not loop.draining):
                    self._record_error(assignment)
                observed.failed(error_code(exc), str(exc))
                raise
            finally:
                if finished is None:
                    # The client went away (cancelled, deadline) or the engine failed: free the request's caches.
                    loop.cancel(handle.request_id, detach=True)
            observed.completed(handle.prompt_tokens, finished.completion_tokens, finished.finish_reason,
                               finished.stats)
            if assignment is not None:
                self._record(assignment, prepared, finished, first_token_at, token_ids)
            yield ChoiceEnd(index, finished.finish_reason, handle.prompt_tokens, finished.completion_tokens,
                            finished.stats, request_id)
        finally:
            observed.end()  # a no-op unless the client went away (cancelled, deadline) mid-stream

    def abort(self, request_id: str, tenant: str = "") -> bool:
        """Stop a running request (every choice of it) on whichever loop runs it; False if none does. Only the
        tenant's own requests: another tenant's same id is another engine id."""
        if self.loop is None:
            raise EngineUnavailable("not ready: the engine is still loading")
        loops = [self.loop, *(loop for loop in self.loops.values() if loop is not self.loop)]
        request_id = scoped_id(tenant, request_id)
        ids = self._choices.get(request_id, [request_id])
        return any([loop.cancel(engine_id) for engine_id in ids for loop in loops])

    def _route(self, prepared: PreparedRequest, loop: ServingLoop, observed: RequestObserver, tenant: str = ""):
        """The canary assignment (None without a canary) and the loop that serves the request. The tenant keys the
        assignment (the same session id in two tenants is placed independently) and is recorded with the outcome,
        so the analysis can cap each tenant's weight."""
        if self.canary is None:
            return None, loop
        assignment = self.canary.arm_for(prepared.session_id, prepared.request_id, tenant)
        if assignment is None:
            return None, loop
        arm_loop = self.loops.get(assignment.arm.name)
        if arm_loop is None:  # not served here: the baseline, unrecorded
            return None, loop
        if observed.span is not None:
            observed.span.set_attribute("tandem.canary.arm", assignment.arm.name)
        return assignment, arm_loop

    def _record(self, assignment, prepared: PreparedRequest, finished: Finished, first_token_at: float | None,
                token_ids: list[int]) -> None:
        from tandem.canary.observations import Outcome

        try:
            self.canary.record(assignment, Outcome.from_request(assignment.session, finished.stats, first_token_at,
                                                                time.monotonic(), finished.completion_tokens))
            self.canary.check_greedy(assignment, prepared.params.greedy, prepared.prompt_ids, token_ids)
        except Exception:  # the canary never fails a request
            log.exception("canary: recording a request failed")

    def _record_error(self, assignment) -> None:
        from tandem.canary.observations import Outcome

        try:
            self.canary.record(assignment, Outcome(assignment.session, error=True))
        except Exception:
            log.exception("canary: recording a request failed")
