"""Errors in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, and the gateway's errors mapped to them.

The gateway's InvalidArgument messages start with the offending field in the gRPC request's terms
("chat.messages[0].role: ...", "speculation.max_k: ..."); `param_of` renames it to the OpenAI body's field, so a
client sees `param` and the message name the same field it sent.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi.responses import JSONResponse, Response

from tandem.errors import BackendUnavailable, ContextLengthExceeded, InvalidArgument
from tandem.gateway.events import EngineFailed, EngineUnavailable, QueueFull, TenantBusy
from tandem.sessions import StoreUnavailable, UpdateConflict

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = "1"  # 429 and 503: the OpenAI SDKs honour Retry-After when they retry
_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


@dataclass(slots=True)
class OpenAIError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": RETRY_AFTER_SECONDS} if self.status in (429, 503) else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


def response_not_found(response_id: str) -> OpenAIError:
    return OpenAIError(404, f"Response with id '{response_id}' not found.")


def unauthorized(message: str = "Incorrect API key provided.") -> OpenAIError:
    """The shape a missing or wrong API key gets (--api-keys)."""
    return OpenAIError(401, message, "invalid_request_error", code="invalid_api_key")


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def not_ready(message: str) -> OpenAIError:
    return OpenAIError(503, message, "service_unavailable", code="not_ready")


def param_of(message: str, renames: dict[str, str]) -> tuple[str | None, str]:
    """(the OpenAI field a gateway message names, the message with that name): "chat.messages[2].role: ..." ->
    ("messages[2].role", "messages[2].role: ...")."""
    match = _FIELD.match(message)
    if match is None:
        return None, message
    field = match.group(1)
    for source in sorted(renames, key=len, reverse=True):  # the longest prefix wins: chat.messages before chat
        if field == source or field.startswith((source + ".", source + "[")):
            field = renames[source] + field[len(source):]
            break
    return field, field + message[match.end(1):]


def from_exception(exc: Exception, renames: dict[str, str]) -> OpenAIError:
    """The OpenAI error a gateway failure gets; an engine failure's own text stays in the server log."""
    if isinstance(exc, InvalidArgument):
        param, message = param_of(str(exc), renames)
        code = "context_length_exceeded" if isinstance(exc, ContextLengthExceeded) else None
        return OpenAIError(400, message, param=param, code=code)
    if isinstance(exc, TenantBusy):
        return OpenAIError(429, str(exc), "rate_limit_error", code="tenant_concurrency")
    if isinstance(exc, QueueFull):
        return OpenAIError(429, str(exc), "rate_limit_error", code="queue_full")
    if isinstance(exc, EngineUnavailable | BackendUnavailable):
        return OpenAIError(503, str(exc), "service_unavailable", code="unavailable")
    if isinstance(exc, StoreUnavailable):
        return OpenAIError(503, str(exc), "service_unavailable", code="store_unavailable")
    if isinstance(exc, UpdateConflict):  # stored state other replicas kept changing: the SDKs retry a 409
        return OpenAIError(409, f"{exc}; nothing was changed, retry", "conflict_error", code="update_conflict")
    if isinstance(exc, EngineFailed):
        log.warning("request failed in the engine: %s", exc)
    else:
        log.exception("request failed", exc_info=exc)
    return OpenAIError(500, "The server failed while generating; the error is in its log.", "server_error")


def validation_error(errors: list[dict]) -> OpenAIError:
    """A pydantic ValidationError's first error as a 400 naming the field (OpenAI answers 400, not FastAPI's 422)."""
    first = errors[0]
    param = _loc_param(first.get("loc", ()))
    message = first.get("msg", "invalid value")
    return bad_request(f"{param}: {message}" if param else message, param)


def _loc_param(loc: tuple) -> str | None:
    """("messages", 0, "content") -> "messages[0].content"; a union member's tag ("str", "list[int]") ends it."""
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            if not parts:
                break
            parts[-1] += f"[{item}]"
        elif isinstance(item, str) and item.isidentifier() and item not in _TYPE_TAGS and not item[:1].isupper():
            parts.append(item)
        else:
            break
    return ".".join(parts) or None


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


Handler = Callable[..., Awaitable[Response]]


def in_openai_shape(handler: Handler) -> Handler:
    """A route whose errors are answered in OpenAI's shape (an unexpected one as a 500 without internal text)."""
    @functools.wraps(handler)  # (FastAPI reads the parameters through it)
    async def answered(*args, **kwargs) -> Response:
        try:
            return await handler(*args, **kwargs)
        except Exception as exc:
            return (exc if isinstance(exc, OpenAIError) else from_exception(exc, {})).response()

    return answered
