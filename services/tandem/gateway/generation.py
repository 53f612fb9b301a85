"""Generations: what a gateway does with one generate request, whatever the transport (gRPC or OpenAI HTTP).

A request is validated and tokenized (off the event loop: a long prompt must not stall other streams), placed on an
arm by the arm router when one runs (gateway.arms), submitted to that arm's serving loop once per choice (`n`), and
streamed back as events (gateway.events). Closing the stream early (the client went away) cancels every choice and
frees its caches on every worker. Failures are raised as the gateway's typed errors; each transport maps them to its
own status codes. One choice's run (arm placement, detokenizing, tool calls) is gateway.choice_stream.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import replace

from tandem.engines import Backend
from tandem.errors import InvalidArgument, request_id_in_use
from tandem.gateway.arms import ArmRouter
from tandem.gateway.auth import MAX_PRIORITY
from tandem.gateway.choice_stream import ChoiceStream
from tandem.gateway.events import DRAINING, ChoiceEnd, EngineUnavailable, Event, TenantBusy, error_code
from tandem.gateway.interleave import interleave
from tandem.gateway.lanes import ServingLoop
from tandem.gateway.request_registry import Claim, LocalRegistry, RequestRegistry
from tandem.gateway.validate import (
    BACKGROUND_PRIORITY,
    GatewayLimits,
    PreparedRequest,
    chat_ids,
    encode_prompt,
    prepare,
)
from tandem.telemetry.gateway import RequestObserver
from tandem.telemetry.metrics import GatewayMetrics
from tandem.v1 import generation_pb2 as pb

SEED_STRIDE = 0x9E3779B97F4A7C15  # choice i > 0 of a seeded request samples with a seed derived from the client's


def scoped_id(tenant: str, id_: str) -> str:
    """An id inside the gateway: the tenant's namespace in front (tenant names hold no ':'), so one tenant's request
    and session ids never reach another's requests, session state or retained KV caches."""
    return f"{tenant}:{id_}" if tenant and id_ else id_


# Between a request's id and its choice's index in the choice's engine id: a control character, which no client's id
# may hold (gateway.validate refuses them), so a choice's id never names another request, nor a request a choice.
CHOICE_SEPARATOR = "\x1f"


def choice_ids(request_id: str, n: int) -> list[str]:
    """Engine request ids of a request's choices: the request's own id when n is 1."""
    return [request_id] if n == 1 else [f"{request_id}{CHOICE_SEPARATOR}{index}" for index in range(n)]


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


class Generations(ChoiceStream):
    """The gateway's generate path over loaded engines: one serving loop per arm, the first the baseline (model info
    describes it; requests no arm router placed run on it)."""

    def __init__(self, backend: Backend, loops: Mapping[str, ServingLoop], limits: GatewayLimits | None = None,
                 metrics: GatewayMetrics | None = None, tenant_limits: Mapping[str, int] | None = None,
                 tenant_queue_share: float = 1.0, arm_router: ArmRouter | None = None,
                 tenant_priorities: Mapping[str, int] | None = None,
                 registry: RequestRegistry | None = None) -> None:
        """backend: the baseline arm's; loops: every arm's, the baseline's first. tenant_limits: tenant -> most
        requests in flight at once (absent: no cap). tenant_queue_share: the most of the queue (max_requests) one
        named tenant may hold, so one client cannot fill it for the rest (1.0: no share cap; requests without a
        tenant, as without API keys, are one caller and take the whole queue). tenant_priorities: tenant -> what
        is added to each of its requests' priority (its key's; absent: 0). registry: where the ids running on every
        gateway replica are (gateway.request_registry; None: this gateway's alone)."""
        if not loops:
            raise InvalidArgument("loops: the generate path needs at least one serving loop")
        self.backend = backend
        self.loops = dict(loops)
        self.loop = next(iter(self.loops.values()))
        self.model_limits = backend.model_limits
        self.limits = limits or GatewayLimits()
        self.metrics = metrics
        self.tenant_limits = dict(tenant_limits or {})
        self.tenant_queue_share = tenant_queue_share
        self.tenant_priorities = dict(tenant_priorities or {})
        self.arm_router = arm_router
        self.registry: RequestRegistry = registry or LocalRegistry()
        self._choices: dict[str, list[str]] = {}  # scoped request id -> its choices' engine ids, while it runs
        # tenant -> [requests in flight, queue places they hold (a request's n choices each take one)], for the
        # tenants with a cap: max_concurrency counts requests, the queue share counts places, as the engine's queue.
        self._tenant_active: dict[str, list[int]] = {}

    @property
    def tokenizer(self):
        return self._serving()[0].tokenizer

    @property
    def target_name(self) -> str:
        return self._serving()[0].target_name

    def _serving(self) -> tuple[Backend, ServingLoop]:
        if self.loop.draining:
            raise EngineUnavailable(DRAINING)
        return self.backend, self.loop

    def room_for(self, tenant: str) -> tuple[int | None, int]:
        """What one client call of `tenant` may take at once: (requests, each of a body's prompts being one: its
        key's max_concurrency, None for no cap; sequences, the places of the engine's queue: --max-queue, or the
        tenant's share of it). A call past either could never run: a 400, not a 429 its client would retry."""
        requests_cap, places_cap = self.tenant_caps(tenant, self.loop.max_requests)
        return requests_cap, min(self.loop.max_requests, places_cap or self.loop.max_requests)

    def check_choices(self, choices: int) -> None:
        """InvalidArgument naming n where one request's choices (each a sequence) are more than the engine's queue
        holds: that request could never run, and a queue-full answer would have its client retry in vain."""
        if choices > (limit := self.loop.max_requests):
            raise InvalidArgument(f"n: {choices} choices a request, more than this server's queue holds ({limit}, "
                                  "--max-queue)")

    async def prepare(self, request: pb.GenerateRequest) -> PreparedRequest:
        """Validate and tokenize in a worker thread; raises InvalidArgument naming the field."""
        backend, _ = self._serving()
        return await asyncio.to_thread(prepare, request, backend.tokenizer, self.limits, self.model_limits,
                                       backend.engine.eos_token_ids)

    async def tokenize(self, prompt: str | None = None, chat: pb.Chat | None = None, tenant: str = "",
                       special_tokens: bool = True, generation_prompt: bool = True) -> list[int]:
        """The token ids of a prompt (no template) or a chat (template applied), in a worker thread, as a request
        gets them; `special_tokens` False: a prompt's without those its tokenizer adds (a BOS); `generation_prompt`
        False: a chat's without the assistant's turn opened. `tenant` is taken for symmetry with stream/abort:
        tokenizing touches no per-tenant state."""
        backend, _ = self._serving()
        if chat is not None:
            return await asyncio.to_thread(chat_ids, chat, backend.tokenizer, self.limits, generation_prompt)
        if prompt is None:
            raise InvalidArgument("input: set one of prompt or chat")
        if not prompt:
            raise InvalidArgument("prompt: must not be empty")  # as Generate says
        return await asyncio.to_thread(encode_prompt, prompt, backend.tokenizer, self.limits, special_tokens)

    async def stream(self, request: pb.GenerateRequest, metadata: Sequence = (), tenant: str = "",
                     background: bool = False, admitted: asyncio.Event | None = None) -> AsyncIterator[Event]:
        """Every choice's events, interleaved as they come; a choice's ChoiceEnd is its last event. `tenant`: the
        authenticated caller's (the transport's to say; "" without API keys), which namespaces its ids;
        `background`: the request runs behind every client's request (BACKGROUND_PRIORITY); `admitted`: set once
        the engine's queue has taken a choice (before, the stream raises what refuses it: a full queue, ...)."""
        _, loop = self._serving()
        requests_cap, places_cap = self.tenant_caps(tenant, loop.max_requests)
        if requests_cap is None and places_cap is None:
            async for event in self._stream(request, metadata, tenant, background, admitted):
                yield event
            return
        places = min(max(1, request.n), self.limits.max_choices)  # (an n past the limit is refused in _stream)
        if places_cap is not None and places > places_cap:  # it could never run: not a retry-later
            raise InvalidArgument(f"n: {places} choices take {places} places of the queue, more than this tenant's "
                                  f"share ({places_cap})")
        held = self._tenant_active.setdefault(tenant, [0, 0])
        if requests_cap is not None and held[0] >= requests_cap:
            raise TenantBusy(f"tenant {tenant!r} has {held[0]} requests queued or running (its limit is "
                             f"{requests_cap}); retry later")
        if places_cap is not None and held[1] + places > places_cap:
            raise TenantBusy(f"tenant {tenant!r} holds {held[1]} places of the queue and asks for {places} more "
                             f"(its share is {places_cap}; a request takes one place per choice); retry later")
        held[0], held[1] = held[0] + 1, held[1] + places
        try:
            async for event in self._stream(request, metadata, tenant, background, admitted):
                yield event
        finally:
            held[0], held[1] = held[0] - 1, held[1] - places
            if held[0] == 0:
                del self._tenant_active[tenant]

    def tenant_caps(self, tenant: str, max_requests: int) -> tuple[int | None, int | None]:
        """(the most requests `tenant` may have queued or running: its key's max_concurrency, the most places of a
        queue of `max_requests` they may hold: its share), each None for no cap. The engine's queue gives each of
        a request's n choices a place, so the share counts places."""
        if not tenant:
            return None, None
        share = max(1, int(max_requests * self.tenant_queue_share)) if self.tenant_queue_share < 1.0 else None
        return self.tenant_limits.get(tenant), share

    async def _stream(self, request: pb.GenerateRequest, metadata: Sequence, tenant: str,
                      background: bool, admitted: asyncio.Event | None) -> AsyncIterator[Event]:
        backend, loop = self._serving()
        observed = RequestObserver(self.metrics, request, metadata, backend.target_name)
        try:
            prepared = await self.prepare(request)
            self.check_choices(prepared.n)
        except InvalidArgument as exc:
            observed.failed(error_code(exc), str(exc))
            raise
        client_id = prepared.request_id  # what the client sees back; the engine sees the scoped one
        # The tenant's own priority first (its key's, capped at a client's largest), then the gateway's background.
        priority = min(prepared.priority + self.tenant_priorities.get(tenant, 0), MAX_PRIORITY)
        prepared = replace(prepared, request_id=scoped_id(tenant, prepared.request_id),
                           session_id=scoped_id(tenant, prepared.session_id),
                           priority=priority + (BACKGROUND_PRIORITY if background else 0))
        choices = [choice_request(prepared, index) for index in range(prepared.n)]
        if prepared.request_id in self._choices:  # whatever either's n: one id names one request (abort stops it)
            self._refuse_id(client_id, observed)
        self._choices[prepared.request_id] = [choice.request_id for choice in choices]
        try:
            claim = await self.registry.claim(prepared.request_id, tenant, self.tenant_limits.get(tenant) or 0)
            if claim is not Claim.TAKEN:  # the id runs on another gateway replica, or the tenant's cap is reached
                self._refuse_claim(claim, client_id, tenant, observed)
            if len(choices) == 1:
                async for event in self._choice(0, choices[0], client_id, observed, backend, loop, tenant,
                                                admitted):
                    if isinstance(event, ChoiceEnd):  # free the id before the client hears the request ended
                        await self.registry.release(prepared.request_id)
                    yield event
                return
            # Each choice is a generation of its own to telemetry: its own span and duration.
            observers = [observed] + [RequestObserver(self.metrics, request, metadata, backend.target_name)
                                      for _ in choices[1:]]
            streams = [self._choice(index, choice, client_id, observers[index], backend, loop, tenant, admitted)
                       for index, choice in enumerate(choices)]
            # A failed choice or a client gone stops the others (each frees its caches as it unwinds).
            ended = 0
            async with contextlib.aclosing(interleave(streams)) as events:
                async for event in events:
                    ended += isinstance(event, ChoiceEnd)
                    if ended == len(choices) and isinstance(event, ChoiceEnd):
                        await self.registry.release(prepared.request_id)
                    yield event
        finally:
            self._choices.pop(prepared.request_id, None)
            self.registry.release_soon(prepared.request_id)  # (a failure or a client gone: no await in unwinding)

    @staticmethod
    def _refuse_id(client_id: str, observed: RequestObserver) -> None:
        refused = request_id_in_use(client_id)
        observed.failed(error_code(refused), str(refused))
        raise refused

    def _refuse_claim(self, claim: Claim, client_id: str, tenant: str, observed: RequestObserver) -> None:
        if claim is Claim.ID_IN_USE:
            self._refuse_id(client_id, observed)
        refused = TenantBusy(f"tenant {tenant!r} has {self.tenant_limits[tenant]} requests queued or running on the "
                             f"gateway replicas together (its limit); retry later")
        observed.failed(error_code(refused), str(refused))
        raise refused

    async def abort(self, request_id: str, tenant: str = "") -> bool:
        """Stop a running request (every choice of it), on this gateway or, through the registry, on the replica
        running it; False if none does. Only the tenant's own requests: another tenant's same id is another id."""
        request_id = scoped_id(tenant, request_id)
        return self.abort_here(request_id) or await self.registry.abort_elsewhere(request_id)

    def abort_here(self, request_id: str) -> bool:
        """abort, for a scoped id, on this gateway's loops alone."""
        ids = self._choices.get(request_id, [request_id])
        return any([loop.cancel(engine_id) for engine_id in ids for loop in self.loops.values()])


# The generate path once the engines have loaded; raises EngineUnavailable(events.NOT_LOADED) while they load.
GenerationsSource = Callable[[], Generations]
