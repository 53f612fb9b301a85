"""Request bodies read and parsed: a size cap checked as the bytes arrive, and every refusal (bad JSON, a wrong type)
a 400 in OpenAI's error shape rather than FastAPI's."""

from __future__ import annotations

import asyncio
import json

from fastapi import Request
from pydantic import BaseModel, ValidationError

from tandem.gateway.openai.errors import OpenAIError, bad_request, validation_error

LARGE_BODY_BYTES = 64 * 1024  # bodies past this are parsed in a worker thread (other streams go on meanwhile)


def _too_large(size: int, limit: int) -> OpenAIError:
    return OpenAIError(413, f"the body is {size} bytes or more, past the limit of {limit} bytes",
                       code="request_too_large")


async def read_body(request: Request, schema: type[BaseModel], limit: int):
    """The body parsed and validated. One past `limit` bytes is refused (413) unread when its Content-Length says
    so, else as soon as that much has arrived; a large one is parsed off the event loop."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    body = b"".join(chunks)
    if len(body) > LARGE_BODY_BYTES:
        return await asyncio.to_thread(parse_body, body, schema)
    return parse_body(body, schema)


def parse_body(body: bytes, schema: type[BaseModel]):
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise bad_request(f"the body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object")
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from exc
