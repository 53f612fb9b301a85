"""The stored responses' own routes: GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items, and for
background responses POST /v1/responses/{id}/cancel and GET /v1/responses/{id}?stream=true&starting_after=N.

They read the store only (gateway.openai.stored) and the background responses' logs, never the engines, so they
answer while the models load. A response another tenant stored, an expired or deleted one, or any id where nothing is
stored, is the same 404.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Mapping

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tandem.gateway.openai.background import BackgroundResponses
from tandem.gateway.openai.errors import bad_request, in_openai_shape, response_not_found
from tandem.gateway.openai.responses_output import sse_event
from tandem.gateway.openai.stored import ResponseStore, StoredResponse, chain_broken
from tandem.gateway.openai.streaming import EventStream

DEFAULT_PAGE, MAX_PAGE = 20, 100  # input_items: OpenAI's default and largest `limit`


def add_stored_routes(app: FastAPI, stored: ResponseStore | None, background: BackgroundResponses | None,
                      tenant_of: Callable[[Request], str], ping_s: float = 0.0) -> None:
    """The routes over `stored` (None: nothing stored, every id a 404) and `background` (what runs background
    responses); `tenant_of`: the caller's tenant, or a 401; `ping_s`: a stream's ping interval (0: none)."""

    async def found(request: Request, response_id: str) -> StoredResponse:
        tenant = tenant_of(request)
        if background is not None:  # (which also ends a background response its replica left unfinished)
            response = await background.current(tenant, response_id)
        else:
            response = await stored.get(tenant, response_id) if stored is not None else None
        if response is None:
            raise response_not_found(response_id)
        return response

    @in_openai_shape
    async def retrieve(request: Request, response_id: str) -> Response:
        query = request.query_params
        if (stream := query.get("stream", "false").lower()) not in ("true", "false"):
            raise bad_request(f"stream: must be true or false, got {query.get('stream')!r}", "stream")
        if stream == "false":
            return JSONResponse((await found(request, response_id)).response)
        try:
            after = int(query.get("starting_after", -1))
        except ValueError:
            raise bad_request(f"starting_after: must be an integer, got {query.get('starting_after')!r}",
                              "starting_after") from None
        if background is None:
            raise response_not_found(response_id)
        return replay(await background.stream(tenant_of(request), response_id, after), ping_s)

    @in_openai_shape
    async def cancel(request: Request, response_id: str) -> JSONResponse:
        if background is None:
            raise response_not_found(response_id)
        return JSONResponse(await background.cancel(tenant_of(request), response_id))

    @in_openai_shape
    async def delete(request: Request, response_id: str) -> JSONResponse:
        tenant = tenant_of(request)
        deleted = background.delete if background is not None else stored.delete if stored is not None else None
        if deleted is None or not await deleted(tenant, response_id):
            raise response_not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @in_openai_shape
    async def input_items(request: Request, response_id: str) -> JSONResponse:
        response = await found(request, response_id)
        if response.items is None:
            raise chain_broken(response_id)
        return JSONResponse(input_items_page(response.items, request.query_params))

    app.add_api_route("/v1/responses/{response_id}", retrieve, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", delete, methods=["DELETE"])
    app.add_api_route("/v1/responses/{response_id}/input_items", input_items, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}/cancel", cancel, methods=["POST"])


def replay(events: AsyncGenerator[dict, None], ping_s: float = 0.0) -> Response:
    """A background response's events (from its log) as an SSE stream, pinged after each `ping_s` seconds without
    one; a client that leaves stops only its read."""
    async def body() -> AsyncGenerator[bytes, None]:
        async for event in events:
            yield sse_event(event)

    return EventStream(body(), events, ping_s)


def input_items_page(items: list[dict], query: Mapping[str, str],
                     order_key: Callable[[str], str | None] | None = None,
                     limits: tuple[int, int] = (DEFAULT_PAGE, MAX_PAGE)) -> dict:
    """A page of `items` as OpenAI lists them: `order` "desc" (newest first, the default) or "asc", `limit` items
    (1-100, default 20) after the item whose id is `after`. `order_key`: where ids sort as the items were made (files,
    batches), an `after` no longer listed (deleted meanwhile, as a loop deleting what it lists does) still places the
    page; elsewhere it is a 400. `limits`: the default and largest `limit` (OpenAI's files list takes up to 10,000)."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request(f"order: must be 'asc' or 'desc', got {order!r}", "order")
    try:
        limit = int(query.get("limit", limits[0]))
    except ValueError:
        limit = 0
    if not 1 <= limit <= limits[1]:
        raise bad_request(f"limit: must be an integer from 1 to {limits[1]}, got {query.get('limit')!r}", "limit")
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if (after := query.get("after")) is not None:
        ids = [item.get("id") for item in ordered]
        if after in ids:
            start = ids.index(after) + 1
        elif order_key is not None and (cursor := order_key(after)) is not None:
            keys = [order_key(item_id) or "" for item_id in ids]
            start = next((index for index, key in enumerate(keys) if (key > cursor if order == "asc" else
                                                                      key < cursor)), len(ordered))
        else:
            raise bad_request(f"after: nothing listed has the id {after!r}", "after")
    page = ordered[start:start + limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(ordered)}
