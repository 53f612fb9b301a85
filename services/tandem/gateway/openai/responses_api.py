"""The Responses API's own routes: POST /v1/responses (over the chat path; stored, background, in a conversation,
truncated to fit) and POST /v1/responses/input_tokens."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tandem.gateway.events import Event
from tandem.gateway.openai.background import BackgroundResponses
from tandem.gateway.openai.bodies import read_body
from tandem.gateway.openai.conversations import ConversationStore
from tandem.gateway.openai.convert import chat_request, check_model
from tandem.gateway.openai.delivery import CLIENT_CLOSED, deliver, error_response
from tandem.gateway.openai.errors import OpenAIError, bad_request
from tandem.gateway.openai.formats import renames as format_renames
from tandem.gateway.openai.responses_input import RENAMES as RESPONSES_RENAMES
from tandem.gateway.openai.responses_input import ResponsesTurn, chat_body
from tandem.gateway.openai.responses_output import ResponseWriter, response_events
from tandem.gateway.openai.schemas import InputTokensRequest, ResponsesRequest
from tandem.gateway.openai.stored import ResponseStore, StoredResponse
from tandem.gateway.openai.stored_routes import replay
from tandem.gateway.openai.streaming import ClientGone
from tandem.gateway.openai.truncation import fitted
from tandem.sessions import StoreUnavailable

if TYPE_CHECKING:
    from tandem.gateway.openai.api import Api

log = logging.getLogger(__name__)


class ResponsesApi:
    def __init__(self, api: Api, stored: ResponseStore | None, background: BackgroundResponses | None,
                 conversations: ConversationStore | None) -> None:
        """api: the app's shared parts (tenant, readiness, the generate path); stored, background, conversations:
        where responses are stored and run in the background, and conversations kept (None: none)."""
        self.api, self.stored, self.background, self.conversations = api, stored, background, conversations

    async def responses(self, request: Request) -> Response:
        renames = RESPONSES_RENAMES
        try:
            tenant = self.api.tenant(request)
            body = await read_body(request, ResponsesRequest, self.api.limits.max_request_bytes)
            turn = await self._turn(tenant, body)
            renames = format_renames(body, turn.renames)
            return await self._respond(request, tenant, body, turn, renames)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        except Exception as exc:
            return error_response(exc, renames)

    async def input_tokens(self, request: Request) -> Response:
        """POST /v1/responses/input_tokens (the SDKs' responses.input_tokens.count): the input tokens a response to
        this body would be given (its usage.input_tokens: template, instructions, tools and a continued conversation
        included), counted without generating."""
        try:
            tenant = self.api.tenant(request)
            body = await read_body(request, InputTokensRequest, self.api.limits.max_request_bytes)
            turn = await self._turn(tenant, body)
            self.api.check_ready()
            generations = self.api.generations()
            check_model(body, generations.target_name)
            ids = await generations.tokenize(chat=chat_request(turn.chat, "input-tokens").chat, tenant=tenant)
            return JSONResponse({"object": "response.input_tokens", "input_tokens": len(ids)})
        except Exception as exc:
            return error_response(exc, RESPONSES_RENAMES)

    async def _turn(self, tenant: str, body: ResponsesRequest) -> ResponsesTurn:
        """The chat `body` asks for, after the conversation it continues; with `truncation: "auto"`, its oldest turns
        dropped where the prompt would not fit (gateway.openai.truncation)."""
        history, after = await self._history(tenant, body.previous_response_id, body.conversation_id())
        if body.truncation != "auto":
            return replace(chat_body(body, history), after=after)
        self.api.check_ready()
        turn, _ = await fitted(body, history, self.api.generations(), tenant)
        return replace(turn, after=after)

    async def _history(self, tenant: str, previous: str | None, conversation: str | None
                       ) -> tuple[list[dict], str | None]:
        """The items a response continuing `previous`, or in `conversation`, starts from (none without either), and
        the stored response they are the conversation and output of, where known (ResponsesTurn.after)."""
        if conversation is not None:
            if previous is not None:
                raise bad_request("conversation: cannot be used with previous_response_id", "conversation")
            if self.conversations is None:
                raise bad_request("conversation: this server stores no conversations (--response-ttl 0)",
                                  "conversation")
            record = await self.conversations.get(tenant, conversation, param="conversation")
            return record["items"], record.get("last_response")
        if previous is None:
            return [], None
        if self.stored is None:
            raise bad_request("previous_response_id: this server stores no responses (--response-ttl 0); send the "
                              "whole conversation in input", "previous_response_id")
        return await self.stored.history(tenant, previous), previous

    async def _respond(self, request: Request, tenant: str, body: ResponsesRequest, turn: ResponsesTurn,
                       renames: dict[str, str]) -> Response:
        """The Responses API over the chat path (gateway.openai.responses_input): one output, whole or streamed,
        stored once finished unless the body says `store: false`; or run in the background."""
        self.api.check_ready()
        generations = self.api.generations()
        check_model(body, generations.target_name)
        if body.background:
            self._check_background(body)
        response_id = body.request_id or f"resp_{uuid.uuid4().hex}"
        stored = self.stored if body.store is not False else None
        writer = ResponseWriter(response_id, generations.target_name, self.api.token_texts(), body, turn.chat.logprobs,
                                store=stored is not None, background=bool(body.background))
        # A client's id names one response: taken at once, atomically across replicas (id_in_use where another
        # holds it), and given up if the response ends unstored (BackgroundResponses.start takes a background one's).
        claimed = body.request_id is not None and stored is not None and not body.background
        if claimed:
            await stored.create(tenant, StoredResponse(writer.response(), turn.items, turn.after))
        kept = False

        async def extend(response: dict) -> None:
            """A conversation the response is in gains its input and output once it has ended well (one deleted
            meanwhile gains nothing: the response itself is still answered and stored)."""
            conversation = body.conversation_id()
            if conversation is None or response["status"] not in ("completed", "incomplete"):
                return
            try:
                await self.conversations.extend(tenant, conversation, turn.inputs + response["output"],
                                                response["id"] if response.get("store") else None)
            except (OpenAIError, StoreUnavailable) as exc:
                log.warning("response %s: conversation %s not extended: %s", response["id"], conversation,
                            getattr(exc, "message", exc))

        async def keep(response: dict) -> None:
            nonlocal kept
            kept = True
            await extend(response)
            if stored is not None:
                await stored.put(tenant, StoredResponse(response, turn.items, turn.after))

        async def release() -> None:
            if claimed and not kept:  # (shielded: a client gone cancels the request's every await)
                await asyncio.shield(stored.delete(tenant, response_id))

        if body.background:
            return await self._in_background(request, tenant, writer, turn, renames, extend)

        async def whole() -> dict:
            response = writer.finished()
            await keep(response)
            return response

        async def body_of(started: AsyncGenerator[Event, None]) -> AsyncGenerator[bytes, None]:
            try:
                async for chunk in response_events(started, writer, renames, keep):
                    yield chunk
            finally:  # a client gone mid-stream
                await release()

        events = generations.stream(chat_request(turn.chat, response_id), list(request.headers.items()),
                                    tenant=tenant, background=self.api.from_batch(request))
        try:
            return await deliver(request, events, body.stream, writer.add, whole, body_of, self.api.sse_ping_s)
        except BaseException:
            await release()
            raise

    def _check_background(self, body: ResponsesRequest) -> None:
        if self.background is None:
            raise bad_request("background: this server stores no responses (--response-ttl 0), so it runs none in "
                              "the background", "background")
        if body.store is False:
            raise bad_request("background: a background response is stored to be read; it cannot have store "
                              "false", "background")

    async def _in_background(self, request: Request, tenant: str, writer: ResponseWriter, turn: ResponsesTurn,
                             renames: dict[str, str], finished: Callable[[dict], Awaitable[None]]) -> Response:
        """Start a background response: answered with it queued, or with its events as they come (a client that
        leaves stops reading, not generating)."""
        admitted = asyncio.Event()
        events = self.api.generations().stream(chat_request(turn.chat, writer.id), list(request.headers.items()),
                                               tenant=tenant, background=self.api.from_batch(request),
                                               admitted=admitted)
        queued = await self.background.start(tenant, writer, turn, events, admitted, renames, finished)
        if not writer.body.stream:
            return JSONResponse(queued)
        return replay(await self.background.stream(tenant, writer.id, -1), self.api.sse_ping_s)
