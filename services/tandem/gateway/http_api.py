"""The gateway's OpenAI-compatible HTTP API: the HTTP half of Gateway (gateway.server).

It opens the stores the API keeps in the session store (stored and background responses, conversations, the Batch
API's files and batches), builds the app and serves it beside gRPC, on a free port when the default one is taken. At
the end of a drain, once the servers have stopped, it closes those stores, each before the one it writes to.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.gateway.handles import SessionStore
    from tandem.gateway.openai.background import BackgroundResponses
    from tandem.gateway.openai.batches import Batches
    from tandem.gateway.openai.conversations import ConversationStore
    from tandem.gateway.openai.files import FileStore
    from tandem.gateway.openai.server import HttpServer
    from tandem.gateway.openai.stored import ResponseStore
    from tandem.gateway.options import GatewayOptions
    from tandem.telemetry.metrics import GatewayMetrics

log = logging.getLogger(__name__)


class HttpApi:
    """Gateway's HTTP API methods; Gateway sets the state below and defines `serving` and `http_status`."""

    options: GatewayOptions
    metrics: GatewayMetrics | None
    sessions: SessionStore | None
    http: HttpServer | None
    stored: ResponseStore | None
    background: BackgroundResponses | None
    files: FileStore | None
    batches: Batches | None
    conversations: ConversationStore | None

    async def _start_http(self) -> None:
        from tandem.gateway.openai.app import create_app
        from tandem.gateway.openai.background import BackgroundResponses
        from tandem.gateway.openai.batches import batch_ttl, open_batches
        from tandem.gateway.openai.conversations import open_conversation_store
        from tandem.gateway.openai.files import open_file_store
        from tandem.gateway.openai.response_log import open_response_log
        from tandem.gateway.openai.server import start_http_server
        from tandem.gateway.openai.stored import open_response_store

        options = self.options
        ports = [options.http_port, 0] if options.http_port_fallback else [options.http_port]
        self.stored = open_response_store(self.sessions, options.response_ttl_s)
        self.conversations = open_conversation_store(self.sessions, options.response_ttl_s)
        if self.stored is not None:
            self.background = BackgroundResponses(
                self.stored, open_response_log(self.sessions, options.response_ttl_s),
                self.metrics.background_end if self.metrics is not None else None)
            if self.metrics is not None:
                self.metrics.attach_background(lambda: self.background.running)
        self.files = open_file_store(self.sessions, batch_ttl(options.response_ttl_s), options.file_storage_bytes)
        if self.files is not None:
            self.batches = open_batches(self.sessions, options.response_ttl_s, self.files,
                                        self.metrics.batch_end if self.metrics is not None else None,
                                        options.batch_concurrency)
            if self.metrics is not None:
                self.metrics.attach_batches(lambda: self.batches.running)
        app = create_app(self.serving, options.limits, self.http_status, options.api_keys, self.stored,
                         self.background, self.conversations, self.files, self.batches, options.allowed_origins,
                         options.sse_ping_s)
        if self.batches is not None:
            self.batches.start()  # (goes on with batches a stopped replica left)
        tls = {"certfile": options.tls_cert, "keyfile": options.tls_key, "client_ca": options.tls_client_ca} \
            if options.tls else None
        for index, port in enumerate(ports):
            try:
                self.http = await start_http_server(app, options.host, port, tls, options.http_keep_alive_s)
                return
            except OSError:
                if index == len(ports) - 1:
                    raise
                # A warning: clients and docs that say :8000 would reach whatever holds it (the bound port is
                # announced once serving).
                log.warning("HTTP port %d is taken: the HTTP API serves on a free port instead (--http-port chooses "
                            "one)", port)

    async def _close_http(self) -> None:
        """The HTTP API's stores, closed once the servers have stopped."""
        if self.background is not None:  # (before the store: what still runs is stored as failed)
            await self.background.close()
        if self.batches is not None:  # (before the files: what finished is written to them)
            await self.batches.close()
            await asyncio.to_thread(self.batches.records.close)
        if self.files is not None:
            await asyncio.to_thread(self.files.close)
        if self.stored is not None:
            await asyncio.to_thread(self.stored.close)
        if self.conversations is not None:
            await asyncio.to_thread(self.conversations.close)
