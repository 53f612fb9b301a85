"""The Conversations API's routes: POST /v1/conversations; GET, POST (metadata) and DELETE /v1/conversations/{id};
POST and GET /v1/conversations/{id}/items; GET and DELETE /v1/conversations/{id}/items/{item_id}.

They read and write the conversation store only (gateway.openai.conversations), never the engines. Items are taken
as the Responses API takes input items (messages with text, function calls and their outputs; gateway.openai.
responses_input), each given an id. A conversation of another tenant, an expired or deleted one, or an unknown id is
the same 404.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tandem.gateway.openai.bodies import check_metadata, read_body
from tandem.gateway.openai.conversations import MAX_NEW_ITEMS, ConversationStore
from tandem.gateway.openai.errors import OpenAIError, bad_request, in_openai_shape
from tandem.gateway.openai.responses_input import input_items
from tandem.gateway.openai.schemas import _Body
from tandem.gateway.openai.stored_routes import input_items_page


class ConversationBody(_Body):
    """POST /v1/conversations, POST /v1/conversations/{id} (metadata), POST .../items (items)."""

    items: list[dict[str, Any]] | None = None
    metadata: Any = None


def add_conversation_routes(app: FastAPI, conversations: ConversationStore | None,
                            tenant_of: Callable[[Request], str], max_body_bytes: int) -> None:
    """The routes over `conversations` (None: none kept, every id a 404 and creating one a 400)."""

    def store() -> ConversationStore:
        if conversations is None:
            raise bad_request("this server stores no conversations (--response-ttl 0)")
        return conversations

    async def body_of(request: Request) -> ConversationBody:
        if request.headers.get("content-length") == "0":  # create takes no field: an empty body is an empty object
            return ConversationBody()
        return await read_body(request, ConversationBody, max_body_bytes)

    def new_items(body: ConversationBody, required: bool) -> list[dict]:
        if body.items is None and not required:
            return []
        if body.items is None or (required and not body.items) or len(body.items) > MAX_NEW_ITEMS:
            raise bad_request(f"items: a list of 1 to {MAX_NEW_ITEMS} items", "items")
        return input_items(body.items, "items")  # (a 400 names the item it cannot take)

    @in_openai_shape
    async def create(request: Request) -> JSONResponse:
        tenant = tenant_of(request)
        body = await body_of(request)
        return JSONResponse(await store().create(tenant, new_items(body, required=False),
                                                 check_metadata(body.metadata)))

    @in_openai_shape
    async def retrieve(request: Request, conversation_id: str) -> JSONResponse:
        return JSONResponse((await store().get(tenant_of(request), conversation_id))["conversation"])

    @in_openai_shape
    async def update(request: Request, conversation_id: str) -> JSONResponse:
        tenant = tenant_of(request)
        metadata = check_metadata((await body_of(request)).metadata)
        record = await store().update(tenant, conversation_id,
                                      lambda record: record["conversation"].update(metadata=metadata))
        return JSONResponse(record["conversation"])

    @in_openai_shape
    async def delete(request: Request, conversation_id: str) -> JSONResponse:
        await store().delete(tenant_of(request), conversation_id)
        return JSONResponse({"id": conversation_id, "object": "conversation.deleted", "deleted": True})

    @in_openai_shape
    async def add_items(request: Request, conversation_id: str) -> JSONResponse:
        tenant = tenant_of(request)
        items = new_items(await body_of(request), required=True)
        await store().extend(tenant, conversation_id, items)
        return JSONResponse({"object": "list", "data": items, "first_id": items[0]["id"],
                             "last_id": items[-1]["id"], "has_more": False})

    @in_openai_shape
    async def list_items(request: Request, conversation_id: str) -> JSONResponse:
        record = await store().get(tenant_of(request), conversation_id)
        return JSONResponse(input_items_page(record["items"], request.query_params))

    @in_openai_shape
    async def item(request: Request, conversation_id: str, item_id: str) -> JSONResponse:
        record = await store().get(tenant_of(request), conversation_id)
        for entry in record["items"]:
            if entry.get("id") == item_id:
                return JSONResponse(entry)
        raise OpenAIError(404, f"Item with id '{item_id}' not found.")

    @in_openai_shape
    async def delete_item(request: Request, conversation_id: str, item_id: str) -> JSONResponse:
        def remove(record: dict) -> None:
            kept = [entry for entry in record["items"] if entry.get("id") != item_id]
            if len(kept) == len(record["items"]):
                raise OpenAIError(404, f"Item with id '{item_id}' not found.")
            record["items"] = kept

        record = await store().update(tenant_of(request), conversation_id, remove)
        return JSONResponse(record["conversation"])

    app.add_api_route("/v1/conversations", create, methods=["POST"])
    app.add_api_route("/v1/conversations/{conversation_id}", retrieve, methods=["GET"])
    app.add_api_route("/v1/conversations/{conversation_id}", update, methods=["POST"])
    app.add_api_route("/v1/conversations/{conversation_id}", delete, methods=["DELETE"])
    app.add_api_route("/v1/conversations/{conversation_id}/items", add_items, methods=["POST"])
    app.add_api_route("/v1/conversations/{conversation_id}/items", list_items, methods=["GET"])
    app.add_api_route("/v1/conversations/{conversation_id}/items/{item_id}", item, methods=["GET"])
    app.add_api_route("/v1/conversations/{conversation_id}/items/{item_id}", delete_item, methods=["DELETE"])

