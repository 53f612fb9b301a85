"""The OpenAI-compatible HTTP API (FastAPI): /v1/chat/completions, /v1/completions, /v1/responses (gateway.openai.
responses_api; its stored and background responses, its input token counts), /v1/conversations, /v1/models (and
/v1/models/{model}), /health, and vLLM's /tokenize, /detokenize and /tokenizer_info.

Requests go through the gateway's own generation path (tandem.gateway.generation.Generations), the one the gRPC
API uses: the same validation, engine loop, arm routing and cancellation. Bodies are parsed here rather than by
FastAPI's parameter binding so that every refusal, a bad JSON body included, is a 400 in OpenAI's error shape.
This module assembles the app (middleware, routes, error handlers, telemetry); the routes' shared parts and the
chat, completion, model and tokenizer routes are gateway.openai.api.
"""

from __future__ import annotations

import inspect

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from tandem.gateway.auth import ApiKeys
from tandem.gateway.generation import GenerationsSource
from tandem.gateway.openai.api import Api, Status
from tandem.gateway.openai.background import BackgroundResponses
from tandem.gateway.openai.batch_routes import add_batch_routes
from tandem.gateway.openai.batches import Batches
from tandem.gateway.openai.conversation_routes import add_conversation_routes
from tandem.gateway.openai.conversations import ConversationStore
from tandem.gateway.openai.errors import OpenAIError, validation_error
from tandem.gateway.openai.files import FileStore, add_file_routes
from tandem.gateway.openai.request_ids import RequestIds
from tandem.gateway.openai.responses_api import ResponsesApi
from tandem.gateway.openai.stored import ResponseStore
from tandem.gateway.openai.stored_routes import add_stored_routes
from tandem.gateway.validate import GatewayLimits
from tandem.telemetry import tracing


def create_app(generations: GenerationsSource, limits: GatewayLimits, status: Status,
               keys: ApiKeys | None = None, stored: ResponseStore | None = None,
               background: BackgroundResponses | None = None,
               conversations: ConversationStore | None = None, files: FileStore | None = None,
               batches: Batches | None = None, allowed_origins: tuple[str, ...] = (), sse_ping_s: float = 0.0
               ) -> FastAPI:
    """The API over the generate path `generations()` returns once the engines have loaded; `limits` bound bodies
    before that; `status` says why it cannot serve; `keys`: the API keys /v1/* asks for (`Authorization: Bearer
    <key>`, else 401), None for none (/health is always open); `stored`: where responses are stored (None: none);
    `background`: what runs background responses (None: `background` refused); `conversations`: where conversations
    are kept (None: none); `files` and `batches`: the Batch API's files and batches (None: none); `allowed_origins`:
    the web origins whose pages may call it from a browser (CORS: preflights answered, the API's answers readable);
    `sse_ping_s`: a stream sends a comment after so long without a byte (0: never; GatewayOptions.sse_ping_s)."""
    # No trailing-slash redirects: Starlette builds their Location from the client's Host header.
    app = FastAPI(title="tandem", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False,
                  **_telemetry())
    if allowed_origins:  # bearer keys, no cookies: no credentials mode
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["*"], expose_headers=["retry-after", "x-request-id"], max_age=600)
    app.add_middleware(RequestIds)
    api = Api(generations, limits, status, keys, sse_ping_s)
    responses = ResponsesApi(api, stored, background, conversations)
    app.add_api_route("/v1/chat/completions", api.chat, methods=["POST"])
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/responses", responses.responses, methods=["POST"])
    app.add_api_route("/v1/responses/input_tokens", responses.input_tokens, methods=["POST"])
    add_stored_routes(app, stored, background, api.tenant, sse_ping_s)
    add_conversation_routes(app, conversations, api.tenant, limits.max_request_bytes)
    add_file_routes(app, files, api.tenant)
    add_batch_routes(app, batches, api.tenant, limits.max_request_bytes)
    app.add_api_route("/v1/models", api.models, methods=["GET", "HEAD"])
    app.add_api_route("/v1/models/{model_id:path}", api.model, methods=["GET", "HEAD"])
    app.add_api_route("/health", api.health, methods=["GET", "HEAD"])  # (HEAD: uptime probes, curl -I)
    app.add_api_route("/tokenize", api.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", api.detokenize, methods=["POST"])
    app.add_api_route("/tokenizer_info", api.tokenizer_info, methods=["GET"])

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        # OpenAI's answer to an unknown URL, in its error shape (Starlette's is {"detail": ...}).
        message = f"Invalid URL ({request.method} {request.url.path})" if exc.status_code in (404, 405) \
            else str(exc.detail)
        response = OpenAIError(exc.status_code, message).response()
        response.headers.update(exc.headers or {})  # a 405's Allow
        return response

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(list(exc.errors())).response()

    return app


def _telemetry() -> dict:
    """FastAPI's own OpenTelemetry (FastAPI 0.165 and later): a server span per API request, on the gateway's tracer
    provider, parent of the generation's span; none for /health (a span per kubelet probe) and none for FastAPI's
    inner steps (dependencies, serialization)."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracer_provider": tracing.provider(), "operation_spans": False,
                          "exclude": lambda scope: scope.get("path") == "/health"}}
