"""The tandem.v1.Generation servicer: validates, submits to the EngineLoop, streams detokenized chunks."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import grpc

from tandem.core.detok import IncrementalDetokenizer
from tandem.core.engine import SpeculativeEngine
from tandem.core.stops import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP
from tandem.errors import BackendUnavailable, InvalidArgument
from tandem.gateway.lanes import ServingLoop
from tandem.gateway.loop import EngineFailed, EngineUnavailable, Finished, QueueFull
from tandem.gateway.validate import GatewayLimits, ModelLimits, prepare
from tandem.telemetry.gateway import RequestObserver
from tandem.telemetry.metrics import GatewayMetrics
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc

log = logging.getLogger(__name__)

FINISH_REASONS = {FINISH_STOP: pb.STOP, FINISH_LENGTH: pb.LENGTH, FINISH_ABORT: pb.ABORT}


@dataclass(slots=True)
class Backend:
    """A loaded engine and what the gateway needs to describe and feed it. `lanes`: more engines over the same
    pools (gateway.lanes), each driven by its own loop; `engine` is the first lane."""

    engine: SpeculativeEngine
    tokenizer: object
    target_name: str
    draft_name: str = ""
    lanes: tuple[SpeculativeEngine, ...] = ()

    @property
    def engines(self) -> list[SpeculativeEngine]:
        return [self.engine, *self.lanes]

    @property
    def model_limits(self) -> ModelLimits:
        spec = self.engine.config.spec
        return ModelLimits(vocab_size=self.engine.verifier.vocab_size,
                           max_k=spec.k_max if self.engine.speculating else 0,
                           context_window=self.engine.verifier.context_window)


STATUS_CODES: dict[type[Exception], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    EngineUnavailable: grpc.StatusCode.UNAVAILABLE,
    BackendUnavailable: grpc.StatusCode.UNAVAILABLE,
    EngineFailed: grpc.StatusCode.INTERNAL,
}


def _status_of(exc: Exception) -> tuple[grpc.StatusCode, str]:
    return next(code for kind, code in STATUS_CODES.items() if isinstance(exc, kind)), str(exc)


def speculation_stats(stats: dict) -> pb.SpeculationStats:
    return pb.SpeculationStats(
        rounds=stats.get("rounds", 0),
        drafted_tokens=stats.get("drafted", 0),
        accepted_tokens=stats.get("accepted", 0),
        acceptance_rate=stats.get("acceptance_rate", 0.0),
        mean_accepted_length=stats.get("mean_accepted_length", 0.0),
        fallback_rounds=stats.get("fallback_rounds", 0),
        acceptance_per_position=stats.get("acceptance_per_position", []),
        draft_failures=stats.get("draft_failures", 0),
    )


def complete_message(request_id: str, prompt_tokens: int, finished: Finished) -> pb.GenerateResponse:
    return pb.GenerateResponse(complete=pb.Complete(
        finish_reason=FINISH_REASONS.get(finished.finish_reason, pb.FINISH_REASON_UNSPECIFIED),
        usage=pb.Usage(prompt_tokens=prompt_tokens, completion_tokens=finished.completion_tokens),
        speculation=speculation_stats(finished.stats),
        request_id=request_id,
    ))


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, limits: GatewayLimits | None = None, metrics: GatewayMetrics | None = None) -> None:
        self.limits = limits or GatewayLimits()
        self.metrics = metrics
        self.backend: Backend | None = None
        self.loop: ServingLoop | None = None
        self._model_limits: ModelLimits | None = None
        # Canary arms (see tandem.canary): arm name -> loop; backend/loop above are the baseline arm's.
        self.loops: dict[str, ServingLoop] = {}
        self.canary = None  # tandem.canary.CanaryController, or None: every request on `loop`

    def attach(self, backend: Backend, loop: ServingLoop, loops: Mapping[str, ServingLoop] | None = None,
               canary=None) -> None:
        """Start serving requests: before this every RPC answers UNAVAILABLE. With canary arms, `backend` and `loop`
        are the baseline arm's (unknown arms fall back to it; GetModelInfo describes it), `loops` every arm's."""
        self._model_limits = backend.model_limits
        self.loops = dict(loops) if loops else {}
        self.canary = canary
        self.backend, self.loop = backend, loop

    def _route(self, prepared, loop: ServingLoop, observed: RequestObserver):
        """The canary assignment (None without a canary) and the loop that serves the request."""
        if self.canary is None:
            return None, loop
        assignment = self.canary.arm_for(prepared.session_id, prepared.request_id)
        if assignment is None:
            return None, loop
        arm_loop = self.loops.get(assignment.arm.name)
        if arm_loop is None:  # not served here: the baseline, unrecorded
            return None, loop
        if observed.span is not None:
            observed.span.set_attribute("tandem.canary.arm", assignment.arm.name)
        return assignment, arm_loop

    async def _ready(self, context: grpc.aio.ServicerContext) -> tuple[Backend, ServingLoop]:
        if self.backend is None or self.loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "not ready: the engine is still loading")
        if self.loop.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "draining: this server is shutting down")
        return self.backend, self.loop

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        backend, loop = await self._ready(context)
        observed = RequestObserver(self.metrics, request, context.invocation_metadata(), backend.target_name)
        status: tuple[grpc.StatusCode, str] | None = None
        try:
            try:
                prepared = prepare(request, backend.tokenizer, self.limits, self._model_limits)
                observed.prepared(prepared)
                assignment, loop = self._route(prepared, loop, observed)
                handle = await loop.submit(prepared.prompt_ids, prepared.params, prepared.request_id,
                                           prepared.session_id, prepared.max_k, trace=observed.span)
            except (InvalidArgument, QueueFull, EngineUnavailable) as exc:
                status = _status_of(exc)
            if status is not None:
                observed.failed(status[0].name, status[1])
                await context.abort(*status)
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
                        yield pb.GenerateResponse(chunk=pb.Chunk(text=text, token_ids=update.token_ids))
            except (InvalidArgument, EngineUnavailable, EngineFailed, BackendUnavailable) as exc:
                status = _status_of(exc)
                # An engine failure or stall counts against the arm; a shutdown (draining) does not.
                if assignment is not None and not isinstance(exc, InvalidArgument) \
                        and (isinstance(exc, EngineFailed) or not loop.draining):
                    self._record_error(assignment)
            finally:
                if finished is None:
                    # The client went away (cancelled, deadline) or the engine failed: free the request's caches.
                    loop.cancel(handle.request_id, detach=True)
            if status is not None:
                observed.failed(status[0].name, status[1])
                await context.abort(*status)
            observed.completed(handle.prompt_tokens, finished.completion_tokens, finished.finish_reason,
                               finished.stats)
            if assignment is not None:
                self._record(assignment, prepared, finished, first_token_at, token_ids)
            yield complete_message(handle.request_id, handle.prompt_tokens, finished)
        finally:
            observed.end()  # a no-op unless the client went away (cancelled, deadline) mid-stream

    def _record(self, assignment, prepared, finished: Finished, first_token_at: float | None,
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

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: required")
        if self.loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "not ready: the engine is still loading")
        loops = [self.loop, *(loop for loop in self.loops.values() if loop is not self.loop)]
        return pb.AbortResponse(found=any(loop.cancel(request.request_id) for loop in loops))

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        if self.backend is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "not ready: the engine is still loading")
        engine = self.backend.engine
        # Off the event loop: a Ray pool asks its workers (each answer bounded by a short timeout).
        target_kv, draft_kv = await asyncio.to_thread(_kv_usages, engine)
        return pb.ModelInfo(
            target_model=self.backend.target_name,
            draft_model=self.backend.draft_name if engine.speculating else "",
            vocab_size=self._model_limits.vocab_size,
            max_k=self._model_limits.max_k,
            **_pool_sizes(engine),
            costs=_cost_model(engine),
            target_kv=target_kv,
            draft_kv=draft_kv,
        )


def _cost_model(engine) -> pb.CostModel:
    costs = engine.costs
    return pb.CostModel(
        draft_step_seconds=costs.draft_step, draft_rows_seconds=dict(costs.draft_rows),
        forward_seconds=dict(costs.verify), acceptance_prior=engine.prior.value,
        draft_forward_seconds=dict(costs.draft_forward),
        batched=[pb.BatchedForward(rows=rows, width=width, seconds=seconds)
                 for (rows, width), seconds in sorted(costs.batched.items())])


def _kv_usages(engine) -> tuple[pb.KVUsage | None, pb.KVUsage | None]:
    """(target, draft) KV usage; the draft's is None when not speculating, either is None if it cannot be read."""
    return _kv_usage(engine.verifier), _kv_usage(engine.drafter) if engine.speculating else None


def _kv_usage(side) -> pb.KVUsage | None:
    try:
        usage = side.kv_usage()
    except Exception:  # only a report: the rest of the model info still answers
        log.warning("reading the KV usage of %s failed", type(side).__name__, exc_info=True)
        return None
    return pb.KVUsage(used_tokens=usage.used, reserved_tokens=usage.reserved, capacity_tokens=usage.capacity)


def _pool_sizes(engine) -> dict[str, int]:
    """Worker counts: the Ray pools' sizes, or one in-process model each."""
    return {"draft_workers": len(engine.drafter.worker_health()) if engine.speculating else 0,
            "target_replicas": len(engine.verifier.worker_health()),
            "tensor_parallel_size": engine.verifier.tensor_parallel()}
