"""The tandem.v1.GenerationService servicer: the gRPC face of the gateway's generate path (gateway.generation); its
registration on a server is gateway.registration's."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from tandem.core.logprobs import TokenLogprob
from tandem.core.stats import SpeculationReport
from tandem.core.stops import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP
from tandem.errors import InvalidArgument
from tandem.gateway.auth import ApiKeys
from tandem.gateway.events import FAILURES, ChoiceDelta, ChoiceEnd, EngineFailed, EngineUnavailable, error_code
from tandem.gateway.generation import GenerationsSource
from tandem.gateway.registration import UNAUTHENTICATED_MESSAGE
from tandem.gateway.tools import FINISH_TOOL_CALLS
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc

log = logging.getLogger(__name__)

FINISH_REASONS = {FINISH_STOP: pb.FINISH_REASON_STOP, FINISH_LENGTH: pb.FINISH_REASON_LENGTH,
                  FINISH_ABORT: pb.FINISH_REASON_ABORT, FINISH_TOOL_CALLS: pb.FINISH_REASON_TOOL_CALLS}


def _status(exc: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, EngineFailed):
        # Its own text (an exception's, which may name the server's files) stays in the log: the client gets what
        # failed ("engine step failed", "add failed") only.
        log.warning("request failed in the engine: %s", exc)
        return grpc.StatusCode.INTERNAL, f"{str(exc).partition(':')[0]}; the error is in the server's log"
    return grpc.StatusCode[error_code(exc)], str(exc)


def speculation_stats(stats: SpeculationReport) -> pb.SpeculationStats:
    return pb.SpeculationStats(
        rounds=stats["rounds"],
        drafted_tokens=stats["drafted"],
        accepted_tokens=stats["accepted"],
        acceptance_rate=stats["acceptance_rate"],
        mean_accepted_length=stats["mean_accepted_length"],
        fallback_rounds=stats["fallback_rounds"],
        acceptance_per_position=stats["acceptance_per_position"],
        draft_failures=stats["draft_failures"],
        predicted_rounds=stats["predicted_rounds"],
        lookup_rounds=stats["lookup_rounds"],
        accepted_lookup_tokens=stats["accepted_lookup_tokens"],
        rejected_lookup_tokens=stats["rejected_lookup_tokens"],
    )


def chunk_message(delta: ChoiceDelta) -> pb.GenerateResponse:
    return pb.GenerateResponse(chunk=pb.Chunk(text=delta.text, token_ids=delta.token_ids, index=delta.index,
                                              logprobs=_logprobs(delta.logprobs),
                                              prompt_logprobs=_logprobs(delta.prompt_logprobs),
                                              tool_calls=[call.to_pb() for call in delta.tool_calls]))


def _logprobs(logprobs: list[TokenLogprob] | None) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                            top=[pb.TopLogprob(token_id=i, logprob=v) for i, v in lp.top])
            for lp in logprobs or ()]


def complete_message(end: ChoiceEnd) -> pb.GenerateResponse:
    return pb.GenerateResponse(complete=pb.Complete(
        finish_reason=FINISH_REASONS.get(end.finish_reason, pb.FINISH_REASON_UNSPECIFIED),
        usage=pb.Usage(prompt_tokens=end.prompt_tokens, completion_tokens=end.completion_tokens,
                       cached_prompt_tokens=end.stats["cached_prompt_tokens"],
                       accepted_prediction_tokens=end.stats["accepted_prediction_tokens"],
                       rejected_prediction_tokens=end.stats["rejected_prediction_tokens"]),
        speculation=speculation_stats(end.stats),
        request_id=end.request_id,
        index=end.index,
    ))


class GenerationServiceServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, generations: GenerationsSource, keys: ApiKeys | None = None) -> None:
        """generations: the generate path, UNAVAILABLE while the engines load; keys: None for no API keys (every
        caller is tenant "")."""
        self.generations = generations
        self.keys = keys

    async def _tenant(self, context: grpc.aio.ServicerContext) -> str:
        """The caller's tenant. AuthInterceptor refuses a call without a known key before this runs; refusing here
        too keeps a servicer mounted without the interceptor from serving such a call as tenant ""."""
        if self.keys is None:
            return ""
        tenant = self.keys.from_metadata(context.invocation_metadata())
        if tenant is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
        return tenant.name

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        status: tuple[grpc.StatusCode, str] | None = None
        tenant = await self._tenant(context)
        try:
            async for event in self.generations().stream(request, context.invocation_metadata(), tenant=tenant):
                yield chunk_message(event) if isinstance(event, ChoiceDelta) else complete_message(event)
        except FAILURES as exc:
            status = _status(exc)
        if status is not None:
            await context.abort(*status)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        try:
            if not request.request_id:
                raise InvalidArgument("request_id: required")
            tenant = await self._tenant(context)
            return pb.AbortResponse(found=await self.generations().abort(request.request_id, tenant=tenant))
        except FAILURES as exc:
            await context.abort(*_status(exc))

    async def Tokenize(self, request: pb.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        try:
            kind = request.WhichOneof("input")
            tenant = await self._tenant(context)
            ids = await self.generations().tokenize(prompt=request.prompt if kind == "prompt" else None,
                                                    chat=request.chat if kind == "chat" else None, tenant=tenant)
            return pb.TokenizeResponse(token_ids=ids)
        except FAILURES as exc:
            await context.abort(*_status(exc))

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.GetModelInfoResponse:
        try:
            generations = self.generations()
        except EngineUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        backend, limits = generations.backend, generations.model_limits
        engine = backend.engine
        # Off the event loop: a Ray pool asks its workers (each answer bounded by a short timeout).
        target_kv, draft_kv = await asyncio.to_thread(_kv_usages, engine)
        return pb.GetModelInfoResponse(
            target_model=backend.target_name,
            draft_model=backend.draft_name if engine.speculating else "",
            vocab_size=limits.vocab_size,
            max_k=limits.max_k,
            **_pool_sizes(engine),
            costs=_cost_model(engine),
            target_kv=target_kv,
            draft_kv=draft_kv,
            context_length=limits.context_window or 0,
            tokenizer=pb.TokenizerInfo(
                eos_token_ids=sorted(engine.eos_token_ids),
                chat_template=bool(getattr(backend.tokenizer, "chat_template", None)),
                max_prompt_tokens=generations.limits.max_prompt_tokens),
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
