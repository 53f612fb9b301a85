"""An `x-request-id` header on every HTTP answer, as OpenAI's API sends one (the SDKs keep it as `_request_id`, for a
client to quote in a report, and to find in a proxy's logs): the client's own, where its request carried a printable
one, else a new id."""

from __future__ import annotations

import uuid

HEADER = b"x-request-id"
MAX_CHARS = 128


class RequestIds:
    """Pure ASGI (Starlette's BaseHTTPMiddleware would cost a task per request, and hold streamed bodies)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = next((value for name, value in scope["headers"] if name == HEADER), b"")
        if not (0 < len(request_id) <= MAX_CHARS and request_id.isascii() and request_id.decode().isprintable()):
            request_id = f"req_{uuid.uuid4().hex}".encode()

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (HEADER, request_id)]
            await send(message)

        await self.app(scope, receive, send_with_id)
