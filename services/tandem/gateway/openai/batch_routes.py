"""The Batch API's routes: POST /v1/batches, GET /v1/batches, GET /v1/batches/{id}, POST /v1/batches/{id}/cancel.

They read and write the batch records (gateway.openai.batches), so they answer on every replica and while the models
load; a batch of another tenant, an expired one, or an unknown id is the same 404.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tandem.gateway.openai.batch_input import ENDPOINTS
from tandem.gateway.openai.batches import Batches
from tandem.gateway.openai.bodies import check_metadata, read_body
from tandem.gateway.openai.errors import bad_request, in_openai_shape
from tandem.gateway.openai.files import expires_after
from tandem.gateway.openai.schemas import _Body
from tandem.gateway.openai.stored_routes import input_items_page


class BatchBody(_Body):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: Any = None
    output_expires_after: Any = None


def add_batch_routes(app: FastAPI, batches: Batches | None, tenant_of: Callable[[Request], str],
                     max_body_bytes: int) -> None:
    """The routes over `batches` (None: no batches kept, creating one a 400); `batches` sends its requests through
    `app`."""
    if batches is not None:
        batches.bind(app)

    def runner() -> Batches:
        if batches is None:
            raise bad_request("this server runs no batches (--response-ttl 0)")
        return batches

    @in_openai_shape
    async def create(request: Request) -> JSONResponse:
        tenant = tenant_of(request)
        body = await read_body(request, BatchBody, max_body_bytes)
        if body.endpoint not in ENDPOINTS:
            raise bad_request(f"endpoint: must be one of {', '.join(ENDPOINTS)}, got {body.endpoint!r}", "endpoint")
        if body.completion_window != "24h":
            raise bad_request(f"completion_window: must be '24h', got {body.completion_window!r}",
                              "completion_window")
        output_expires_in = expires_after(body.output_expires_after, "output_expires_after", runner().files.ttl_s)
        return JSONResponse(await runner().create(tenant, body.input_file_id, body.endpoint,
                                                  check_metadata(body.metadata), output_expires_in))

    @in_openai_shape
    async def listing(request: Request) -> JSONResponse:
        found = await runner().listing(tenant_of(request))
        return JSONResponse(input_items_page(found, request.query_params, runner().records.order_key))

    @in_openai_shape
    async def retrieve(request: Request, batch_id: str) -> JSONResponse:
        return JSONResponse(await runner().current(tenant_of(request), batch_id))

    @in_openai_shape
    async def cancel(request: Request, batch_id: str) -> JSONResponse:
        return JSONResponse(await runner().cancel(tenant_of(request), batch_id))

    app.add_api_route("/v1/batches", create, methods=["POST"])
    app.add_api_route("/v1/batches", listing, methods=["GET"])
    app.add_api_route("/v1/batches/{batch_id}", retrieve, methods=["GET"])
    app.add_api_route("/v1/batches/{batch_id}/cancel", cancel, methods=["POST"])
