"""Api: what every route of the OpenAI-compatible app shares (the caller's tenant from its API key, readiness, the
generate path and its token texts), and the routes it serves itself: /v1/chat/completions, /v1/completions,
/v1/models, /health and vLLM's /tokenize, /detokenize and /tokenizer_info (gateway.openai.app mounts them).

Chat and completion requests go through the gateway's generate path (tandem.gateway.generation.Generations), streamed
as server-sent events or collected into one answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from tandem.gateway.auth import ApiKeys
from tandem.gateway.events import DRAINING, NOT_LOADED
from tandem.gateway.generation import GenerationsSource
from tandem.gateway.openai.batch_input import BATCH_TENANT
from tandem.gateway.openai.bodies import read_body
from tandem.gateway.openai.convert import (
    CHAT_RENAMES,
    COMPLETION_RENAMES,
    chat_requests,
    check_model,
    completion_requests,
    scores_only,
    served_tier,
)
from tandem.gateway.openai.delivery import CLIENT_CLOSED, deliver, error_response
from tandem.gateway.openai.errors import bad_request, from_exception, model_not_found, not_ready, unauthorized
from tandem.gateway.openai.formats import renames as format_renames
from tandem.gateway.openai.responses import SSE_DONE, Kind, Responder, sse
from tandem.gateway.openai.schemas import ChatCompletionRequest, CompletionRequest, _Generate
from tandem.gateway.openai.streaming import ClientGone, merged
from tandem.gateway.openai.tokenize import RENAMES as TOKENIZE_RENAMES
from tandem.gateway.openai.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize, tokenizer_info
from tandem.gateway.openai.tokens import TokenTexts
from tandem.gateway.validate import GatewayLimits

# Why the server cannot take requests now ("loading", "draining", "unavailable"), or None when it can.
Status = Callable[[], str | None]
NOT_READY = {"loading": NOT_LOADED, "draining": DRAINING,
             "unavailable": "no target replica is available; retry later",
             "stalled": "the engine is stalled (a step ran past its deadline); retry later"}


@dataclass(slots=True, frozen=True)
class _Endpoint:
    kind: Kind
    schema: type[BaseModel]
    convert: Callable
    renames: dict[str, str]
    id_prefix: str


CHAT = _Endpoint("chat", ChatCompletionRequest, chat_requests, CHAT_RENAMES, "chatcmpl")
COMPLETION = _Endpoint("completion", CompletionRequest, completion_requests, COMPLETION_RENAMES, "cmpl")


class Api:
    """What every route shares: the caller's tenant, readiness, the generate path and its token texts."""

    def __init__(self, generations: GenerationsSource, limits: GatewayLimits, status: Status,
                 keys: ApiKeys | None = None, sse_ping_s: float = 0.0) -> None:
        self.generations = generations
        self.limits = limits
        self.status = status
        self.keys = keys
        self.sse_ping_s = sse_ping_s  # a stream's ping interval (GatewayOptions.sse_ping_s)
        self.created = int(time.time())
        self._texts: TokenTexts | None = None

    def token_texts(self) -> TokenTexts:
        tokenizer = self.generations().tokenizer
        if self._texts is None or self._texts.tokenizer is not tokenizer:
            self._texts = TokenTexts(tokenizer)
        return self._texts

    def tenant(self, request: Request) -> str:
        """The caller's tenant ("" without API keys); a missing or unknown key is a 401. A batch's request (the
        scope key only this process sets) runs as its batch's tenant while that tenant has a key."""
        if (batch_tenant := request.scope.get(BATCH_TENANT)) is not None:
            if (self.keys is None and batch_tenant == "") or (self.keys is not None and batch_tenant in
                                                                self.keys.tenants):
                return batch_tenant
            raise unauthorized("The API key that created this batch is no longer accepted.")
        if self.keys is None:
            return ""
        if not request.headers.get("authorization"):
            raise unauthorized("You didn't provide an API key: send it as `Authorization: Bearer <key>`.")
        tenant = self.keys.from_authorization(request.headers.get("authorization"))
        if tenant is None:
            raise unauthorized()
        return tenant.name

    @staticmethod
    def from_batch(request: Request) -> bool:
        """Whether this is a batch's request (run behind every client's: gateway.validate.BACKGROUND_PRIORITY)."""
        return request.scope.get(BATCH_TENANT) is not None

    def check_ready(self) -> None:
        if (reason := self.status()) is not None:
            raise not_ready(NOT_READY.get(reason, reason))

    async def health(self) -> JSONResponse:
        reason = self.status()
        return JSONResponse({"status": reason or "ok"}, status_code=503 if reason else 200)

    async def models(self, request: Request) -> JSONResponse:
        try:
            return JSONResponse({"object": "list", "data": [self._model(request)]})
        except Exception as exc:
            return error_response(exc, {})

    async def model(self, request: Request, model_id: str) -> JSONResponse:
        """GET /v1/models/{model} (the SDKs' models.retrieve): the served model, else a 404; /v1/models/ the
        list."""
        if not model_id:
            return await self.models(request)
        try:
            model = self._model(request)
            if model_id != model["id"]:
                raise model_not_found(model_id)
            return JSONResponse(model)
        except Exception as exc:
            return error_response(exc, {})

    def _model(self, request: Request) -> dict:
        self.tenant(request)
        self.check_ready()
        generations = self.generations()
        model = {"id": generations.target_name, "object": "model", "created": self.created, "owned_by": "tandem"}
        if context_window := generations.model_limits.context_window:
            model["max_model_len"] = context_window  # vLLM's name for it; clients size prompts by it
        return model

    async def tokenize(self, request: Request) -> Response:
        return await self._tokens(request, TokenizeRequest, tokenize)

    async def detokenize(self, request: Request) -> Response:
        return await self._tokens(request, DetokenizeRequest, detokenize)

    async def tokenizer_info(self, request: Request) -> Response:
        try:
            self.tenant(request)
            self.check_ready()
            return JSONResponse(await tokenizer_info(self.generations()))
        except Exception as exc:
            return error_response(exc, {})

    async def _tokens(self, request: Request, schema: type[BaseModel], answer: Callable) -> Response:
        """vLLM's /tokenize and /detokenize (gateway.openai.tokenize): API keys and readiness as on /v1."""
        try:
            tenant = self.tenant(request)
            body = await read_body(request, schema, self.limits.max_request_bytes)
            self.check_ready()
            generations = self.generations()
            check_model(body, generations.target_name)
            return JSONResponse(await answer(generations, body, tenant))
        except Exception as exc:
            return error_response(exc, TOKENIZE_RENAMES)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, CHAT)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, COMPLETION)

    async def _generate(self, request: Request, endpoint: _Endpoint) -> Response:
        renames = endpoint.renames
        try:
            tenant = self.tenant(request)  # before the body: an unauthenticated client gets nothing parsed
            body = await read_body(request, endpoint.schema, self.limits.max_request_bytes)
            renames = format_renames(body, renames)
            return await self._serve(request, endpoint, tenant, body, renames)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        except Exception as exc:
            return error_response(exc, renames)

    async def _serve(self, request: Request, endpoint: _Endpoint, tenant: str, body: _Generate,
                     renames: dict[str, str]) -> Response:
        self.check_ready()
        generations = self.generations()
        model = generations.target_name
        check_model(body, model)
        request_id = body.request_id or f"{endpoint.id_prefix}-{uuid.uuid4().hex}"
        messages = endpoint.convert(body, request_id)  # one per prompt
        per_prompt = max(messages[0].n, 1)
        if len(messages) > 1:  # each prompt runs as a request of its own: all of them must fit at once
            requests, places = generations.room_for(tenant)
            if per_prompt * len(messages) > places:
                raise bad_request(f"prompt: {len(messages)} prompts of {per_prompt} choice(s) each are more sequences "
                                  f"than this server's queue holds for a caller ({places}: --max-queue, or a "
                                  "tenant's --tenant-queue-share of it)", "prompt")
            if requests is not None and len(messages) > requests:
                raise bad_request(f"prompt: {len(messages)} prompts run as {len(messages)} requests, more than this "
                                  f"API key's max_concurrency ({requests})", "prompt")
        generations.check_choices(per_prompt * len(messages))
        responder = Responder(endpoint.kind, request_id, model, self.token_texts(), n=per_prompt * len(messages),
                              logprobs=messages[0].HasField("logprobs"), per_prompt=per_prompt,
                              include_usage=body.stream and body.include_usage, token_ids=body.return_token_ids,
                              echo=getattr(body, "echo", False), top_logprobs=messages[0].logprobs,
                              prompt_logprobs=body.prompt_logprobs, service_tier=served_tier(body),
                              scores_only=scores_only(body))
        # headers: a W3C trace context
        streams = [generations.stream(message, list(request.headers.items()), tenant=tenant,
                                      background=self.from_batch(request)) for message in messages]
        events = streams[0] if len(streams) == 1 else merged(streams, per_prompt)

        async def whole() -> dict:
            return await asyncio.to_thread(responder.response)  # prompt logprobs of many choices: seconds of work

        return await deliver(request, events, body.stream, responder.collect, whole,
                             lambda started: _sse(started, responder, renames), self.sse_ping_s)


async def _sse(events: AsyncGenerator, responder: Responder, renames: dict[str, str]) -> AsyncGenerator[bytes, None]:
    async with contextlib.aclosing(events):
        for chunk in responder.first_chunks():
            yield sse(chunk)
        try:
            async for event in events:
                if (chunk := responder.chunk(event)) is not None:
                    yield sse(chunk)
        except Exception as exc:  # after the headers: the error travels as an event (the SDKs raise it)
            yield sse(from_exception(exc, renames).body())
            yield SSE_DONE
            return
        if responder.include_usage:
            yield sse(responder.usage_chunk())
        yield SSE_DONE
