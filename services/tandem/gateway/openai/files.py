"""Files (OpenAI's Files API, for the Batch API): POST /v1/files (a multipart upload), GET /v1/files, GET and DELETE
/v1/files/{id}, GET /v1/files/{id}/content.

A file is a batch's input (purpose "batch", uploaded) or its output and errors (purpose "batch_output", written by
gateway.openai.batches): JSON lines of UTF-8 text, up to MAX_FILE_BYTES. Its object and its content are two records of
the tenant (gateway.openai.records), so listing reads no content; both expire after --response-ttl seconds plus the
24-hour window a batch may run (gateway.openai.batches.batch_ttl), from when they were written (`expires_at`), or
sooner where the client asked (OpenAI's `expires_after`, a batch's `output_expires_after`): such a file is gone once
its expires_at has passed, and its records are deleted when next read. Another tenant's file, an expired or deleted
one, or an unknown id is the same 404.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tandem.gateway.openai.errors import OpenAIError, bad_request, in_openai_shape
from tandem.gateway.openai.records import TenantRecords
from tandem.gateway.openai.stored import store_beside
from tandem.gateway.openai.stored_routes import input_items_page

FILE_PREFIX = "tandem:file:"
MAX_FILE_BYTES = 32 * 1024 * 1024
MAX_IN_MEMORY = 1024
UPLOAD_PURPOSES = ("batch",)  # what a client may upload: a batch's input (other purposes serve OpenAI's other APIs)
EXPIRES_AFTER_S = (3600, 30 * 24 * 3600)  # OpenAI's bounds on expires_after.seconds
LIST_LIMITS = (10_000, 10_000)  # GET /v1/files: OpenAI's default and largest `limit`


def expires_after(value: object, field: str, kept_s: float) -> int | None:
    """The seconds after its creation a file expires, from OpenAI's {"anchor": "created_at", "seconds": N} in
    `field` (None: unset); a 400 beyond OpenAI's bounds or the `kept_s` seconds this server keeps files."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("anchor") != "created_at":
        raise bad_request(f"{field}.anchor: must be 'created_at'", f"{field}.anchor")
    seconds = value.get("seconds")
    if isinstance(seconds, str) and seconds.isdigit():  # a multipart form's fields are text
        seconds = int(seconds)
    low, high = EXPIRES_AFTER_S
    if not isinstance(seconds, int) or isinstance(seconds, bool) or not low <= seconds <= high:
        raise bad_request(f"{field}.seconds: must be an integer between {low} and {high}, got {seconds!r}",
                          f"{field}.seconds")
    if seconds > kept_s:
        raise bad_request(f"{field}.seconds: this server keeps files {int(kept_s)} seconds (--response-ttl past a "
                          f"batch's 24-hour window), so at most that, got {seconds}", f"{field}.seconds")
    return seconds


def not_found(file_id: str, param: str = "id") -> OpenAIError:
    return OpenAIError(404, f"No such File object: {file_id}", param=param)


class FileStore:
    def __init__(self, records: TenantRecords, ttl_s: float, tenant_bytes: int) -> None:
        """tenant_bytes: the most bytes of files one tenant may hold; an upload past it is refused (a batch's
        output files are written whatever it holds: they are bounded by its input)."""
        self.records, self.ttl_s, self.tenant_bytes = records, ttl_s, tenant_bytes

    async def check_room(self, tenant: str, size: int) -> None:
        """A 413 when `size` more bytes would take the tenant past tenant_bytes."""
        held = sum(file["bytes"] for file in await self.listing(tenant))
        if held + size > self.tenant_bytes:
            raise OpenAIError(413, f"this upload ({size} bytes) would take your files past {self.tenant_bytes} bytes "
                                   f"(you hold {held}); delete files you no longer need", code="file_storage_full")

    async def create(self, tenant: str, filename: str, purpose: str, content: bytes,
                     expires_in: int | None = None) -> dict:
        """expires_in: seconds the file lives (expires_after, checked), at most ttl_s; None: ttl_s."""
        created = int(time.time())
        lives = int(self.ttl_s) if expires_in is None else min(expires_in, int(self.ttl_s))
        file = {"id": self.records.new_id(), "object": "file", "bytes": len(content), "created_at": created,
                "expires_at": created + lives, "filename": filename, "purpose": purpose,
                "status": "processed", "status_details": None}
        await self.records.put(tenant, _content_id(file["id"]), {"text": content.decode()})
        await self.records.add(tenant, file["id"], file)
        return file

    async def get(self, tenant: str, file_id: str) -> dict:
        if not self.records.is_id(file_id) or (file := await self.records.get(tenant, file_id)) is None \
                or await self._expired(tenant, file):
            raise not_found(file_id)
        return file

    async def content(self, tenant: str, file_id: str) -> str:
        await self.get(tenant, file_id)
        if (record := await self.records.get(tenant, _content_id(file_id))) is None:
            raise not_found(file_id)
        return record["text"]

    async def delete(self, tenant: str, file_id: str) -> None:
        if not self.records.is_id(file_id) or not await self.records.delete(tenant, file_id):
            raise not_found(file_id)
        await self.records.discard(tenant, _content_id(file_id))

    async def listing(self, tenant: str) -> list[dict]:
        """The tenant's files, oldest first."""
        return [file for file in await self.records.all(tenant) if not await self._expired(tenant, file)]

    async def _expired(self, tenant: str, file: dict) -> bool:
        """Whether `file` is past its expires_at (sooner than its records' TTL: expires_after): its records go."""
        if file["expires_at"] > time.time():
            return False
        await self.records.delete(tenant, file["id"])
        await self.records.discard(tenant, _content_id(file["id"]))
        return True

    def close(self) -> None:
        self.records.close()


def _content_id(file_id: str) -> str:
    return f"{file_id}/content"


def open_file_store(sessions: object, ttl_s: float, tenant_bytes: int) -> FileStore | None:
    """Files beside `sessions` (in its Redis when it is one), up to `tenant_bytes` a tenant (--file-storage-bytes);
    None when ttl_s is 0."""
    if ttl_s <= 0:
        return None
    records = TenantRecords(store_beside(sessions, ttl_s, FILE_PREFIX, MAX_IN_MEMORY), "file", "file-")
    return FileStore(records, ttl_s, tenant_bytes)


def add_file_routes(app: FastAPI, files: FileStore | None, tenant_of: Callable[[Request], str]) -> None:
    def store() -> FileStore:
        if files is None:
            raise bad_request("this server stores no files (--response-ttl 0)")
        return files

    @in_openai_shape
    async def upload(request: Request) -> JSONResponse:
        tenant = tenant_of(request)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_FILE_BYTES + 64 * 1024:
            raise OpenAIError(413, f"a file may hold up to {MAX_FILE_BYTES} bytes", code="file_too_large")
        async with request.form(max_files=1, max_fields=4) as form:
            purpose, upload = form.get("purpose"), form.get("file")
            if purpose not in UPLOAD_PURPOSES:
                raise bad_request(f"purpose: must be one of {', '.join(UPLOAD_PURPOSES)} (this server keeps files "
                                  f"for its Batch API), got {purpose!r}", "purpose")
            asked = {key[len("expires_after["):-1]: value for key, value in form.items()
                     if key.startswith("expires_after[") and key.endswith("]")}
            expires_in = expires_after(asked or None, "expires_after", store().ttl_s)
            if upload is None or isinstance(upload, str):
                raise bad_request("file: a file is required (multipart/form-data)", "file")
            content = await upload.read(MAX_FILE_BYTES + 1)
            filename = upload.filename or "upload.jsonl"
        if len(content) > MAX_FILE_BYTES:
            raise OpenAIError(413, f"a file may hold up to {MAX_FILE_BYTES} bytes", code="file_too_large")
        try:
            content.decode()
        except UnicodeDecodeError:
            raise bad_request("file: must be UTF-8 text (JSON lines)", "file") from None
        await store().check_room(tenant, len(content))
        return JSONResponse(await store().create(tenant, filename, purpose, content, expires_in))

    @in_openai_shape
    async def listing(request: Request) -> JSONResponse:
        tenant = tenant_of(request)
        found = await store().listing(tenant)
        if (purpose := request.query_params.get("purpose")) is not None:
            found = [file for file in found if file["purpose"] == purpose]
        return JSONResponse(input_items_page(found, request.query_params, store().records.order_key, LIST_LIMITS))

    @in_openai_shape
    async def retrieve(request: Request, file_id: str) -> JSONResponse:
        return JSONResponse(await store().get(tenant_of(request), file_id))

    @in_openai_shape
    async def content(request: Request, file_id: str) -> Response:
        return Response(await store().content(tenant_of(request), file_id), media_type="application/jsonl")

    @in_openai_shape
    async def delete(request: Request, file_id: str) -> JSONResponse:
        await store().delete(tenant_of(request), file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    app.add_api_route("/v1/files", upload, methods=["POST"])
    app.add_api_route("/v1/files", listing, methods=["GET"])
    app.add_api_route("/v1/files/{file_id}", retrieve, methods=["GET"])
    app.add_api_route("/v1/files/{file_id}", delete, methods=["DELETE"])
    app.add_api_route("/v1/files/{file_id}/content", content, methods=["GET"])
