"""A Batch API input file read (one request a line, OpenAI's format) and its results written as OpenAI does.

Input line: {"custom_id": "...", "method": "POST", "url": "<the batch's endpoint>", "body": {...}}; custom_ids are
unique within a file. Each result is a line of the output file (a 2xx answer) or of the error file (any other
answer, or a request the batch never ran): {"id", "custom_id", "response": {"status_code", "request_id", "body"} or
null, "error": {"code", "message"} or null}.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from tandem.gateway.openai.bodies import lone_surrogate

# The ASGI scope key naming the tenant a batch's request runs as (gateway.openai.batch_run): set in process only, so
# no client's request carries it, and checked against the API keys of the moment (api.Api.tenant).
BATCH_TENANT = "tandem.batch_tenant"
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
MAX_REQUESTS = 50_000  # OpenAI's limit on the requests of one batch
MAX_ERRORS = 20  # the validation errors a failed batch lists


@dataclass(slots=True, frozen=True)
class BatchRequest:
    custom_id: str
    body: dict


def read_requests(content: str, endpoint: str) -> tuple[list[BatchRequest], list[dict]]:
    """The file's requests, and the validation errors found ({"code", "message", "param", "line"}, at most
    MAX_ERRORS; none: the batch may run)."""
    requests: list[BatchRequest] = []
    errors: list[dict] = []
    seen: set[str] = set()

    def error(line: int, code: str, message: str, param: str | None = None) -> None:
        if len(errors) < MAX_ERRORS:
            errors.append({"code": code, "message": message, "param": param, "line": line})

    for number, text in enumerate(content.splitlines(), start=1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
            surrogate = lone_surrogate(line, text.encode()) if isinstance(line, dict) else None
        except ValueError:
            error(number, "invalid_json_line", "This line is not valid JSON.")
            continue
        except RecursionError:
            error(number, "invalid_json_line", "This line nests arrays or objects too deeply.")
            continue
        if not isinstance(line, dict):
            error(number, "invalid_json_line", "This line is not a JSON object.")
            continue
        if (where := surrogate) is not None:
            error(number, "invalid_json_line", f"{where}: holds an unpaired UTF-16 surrogate escape, which is no "
                  "character.", where)
            continue
        custom_id, body = line.get("custom_id"), line.get("body")
        if not isinstance(custom_id, str) or not custom_id:
            error(number, "missing_required_parameter", "custom_id: a non-empty string is required.", "custom_id")
        elif custom_id in seen:
            error(number, "duplicate_custom_id", f"custom_id {custom_id!r} is used by another line.", "custom_id")
        elif line.get("method") != "POST":
            error(number, "invalid_method", "method: must be POST.", "method")
        elif line.get("url") != endpoint:
            error(number, "mismatched_url", f"url: must be the batch's endpoint, {endpoint}.", "url")
        elif not isinstance(body, dict):
            error(number, "invalid_body", "body: a JSON object is required.", "body")
        elif body.get("stream"):
            error(number, "invalid_body", "body.stream: a batch's requests are answered whole.", "body.stream")
        elif body.get("background"):  # it would run on outside the batch (its concurrency, its priority)
            error(number, "invalid_body", "body.background: a batch runs its requests itself.", "body.background")
        else:
            seen.add(custom_id)
            requests.append(BatchRequest(custom_id, body))
    if not requests and not errors:
        error(0, "empty_file", "The input file holds no requests.")
    if len(requests) > MAX_REQUESTS:
        error(0, "too_many_requests", f"A batch may hold up to {MAX_REQUESTS} requests, got {len(requests)}.")
    return requests, errors


def answered(custom_id: str, status_code: int, request_id: str, body: object) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": request_id, "body": body}, "error": None}


def not_run(custom_id: str, code: str, message: str) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines).encode()
