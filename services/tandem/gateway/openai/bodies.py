"""Request bodies read and parsed: a size cap checked as the bytes arrive, and every refusal (bad JSON, a wrong type)
a 400 in OpenAI's error shape rather than FastAPI's."""

from __future__ import annotations

import asyncio
import json

from fastapi import Request
from pydantic import BaseModel, ValidationError

from tandem.gateway.openai.errors import OpenAIError, bad_request, validation_error

LARGE_BODY_BYTES = 64 * 1024  # bodies past this are parsed in a worker thread (other streams go on meanwhile)
MAX_METADATA = 16  # OpenAI's metadata: key-value pairs, keys up to 64 characters, values up to 512


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
        return _parse_body(body, schema)
    except RecursionError:  # arrays or objects nested past what Python's parser (or a walk over the value) takes
        raise bad_request("the body nests arrays or objects too deeply") from None


def _parse_body(body: bytes, schema: type[BaseModel]):
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise bad_request(f"the body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object")
    if (where := lone_surrogate(data, body)) is not None:
        raise bad_request(f"{where}: holds an unpaired UTF-16 surrogate escape, which is no character", param=where)
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from exc


def lone_surrogate(data: object, text: bytes) -> str | None:
    """Where in a parsed JSON value a string holds an unpaired surrogate (JSON's "\ud800" escape alone), as
    `field.sub[2]`; None where none does. Such a string is valid JSON but no text: UTF-8, protobuf and the tokenizer
    refuse it. Only a value whose JSON `text` escapes a surrogate is walked."""
    if b"\\ud" not in text.lower():
        return None
    return _walk(data, "")


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _walk(value: object, where: str) -> str | None:
    if isinstance(value, str):
        return None if _is_text(value) else where or "the value"
    if isinstance(value, dict):
        for key, item in value.items():
            if not _is_text(key):  # a name that is no text: the place is its parent's (the name cannot be shown)
                return where or "a field name"
            if (found := _walk(item, f"{where}.{key}" if where else key)) is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            if (found := _walk(item, f"{where}[{index}]")) is not None:
                return found
    return None


def check_metadata(metadata: object) -> dict[str, str]:
    """A request's `metadata` within OpenAI's limits (a 400 naming it past them)."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in metadata.items()):
        raise bad_request(f"metadata: at most {MAX_METADATA} pairs of strings, keys up to 64 characters and values up "
                          "to 512", "metadata")
    return dict(metadata)
