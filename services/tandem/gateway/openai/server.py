"""uvicorn on the gateway's own event loop: the HTTP API shares the engine loop with gRPC without a thread.

`uvicorn.Server.serve()` would install its own SIGINT/SIGTERM handlers over the gateway's (which drain), so the
server is driven through its parts instead: the socket is bound here (a busy port is an OSError naming the address,
port 0 a free one whose number is then known), `startup` serves it, `main_loop` runs as a task until `stop`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl

import uvicorn

log = logging.getLogger(__name__)

MIN_SHUTDOWN_SECONDS = 0.5
# A client gone without closing its connection (a crashed host, a dropped NAT entry, a cable pulled) sends nothing, so
# a whole response it waits for generates on, and a stream's writes are retransmitted for about 15 minutes (Linux's
# tcp_retries2). TCP keepalive probes an idle connection after KEEPALIVE_IDLE_S, every KEEPALIVE_INTERVAL_S, and
# gives up after KEEPALIVE_PROBES unanswered; TCP_USER_TIMEOUT gives written bytes as long to be acknowledged. The
# connection then fails, uvicorn reports the client gone, and its request ends (as gRPC's keepalive ends a gRPC one).
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 30, 10, 3


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, as socket.create_server makes it but with its protocol named: asyncio turns Nagle's
    algorithm off (TCP_NODELAY) only on connections whose socket says IPPROTO_TCP, and with it on, a keep-alive
    request waited about 40 ms for the client's delayed ACK (uvicorn writes a response's head and body apart)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        _keepalive(sock)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        sock.listen(2048)
        return sock
    except OSError as exc:
        sock.close()
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        raise OSError(f"cannot listen on {address} for HTTP: {exc.strerror or exc}") from exc


def _keepalive(sock: socket.socket) -> None:
    """TCP keepalive and a user timeout on `sock`, which the connections it accepts inherit (Linux; elsewhere the
    system's keepalive defaults, where it has the options)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
                        ("TCP_USER_TIMEOUT", 1000 * (KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_PROBES))):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class HttpServer:
    """A started uvicorn server; `port` is the bound one."""

    def __init__(self, server: uvicorn.Server, sock: socket.socket, task: asyncio.Task) -> None:
        self.server, self.socket, self.task = server, sock, task
        self.host: str = server.config.host
        self.port: int = sock.getsockname()[1]
        self.scheme = "https" if server.config.is_ssl else "http"
        self._stopped: asyncio.Task | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    def stop(self, grace: float = 0.0) -> asyncio.Task:
        """Stop accepting connections, let responses in flight finish for up to `grace` seconds, then cancel them
        (idempotent)."""
        if self._stopped is None:
            self._stopped = asyncio.ensure_future(self._stop(grace))
        return self._stopped

    async def _stop(self, grace: float) -> None:
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        # Read when shutdown waits on open responses: past it, uvicorn cancels them (closing their generations).
        # At least a moment: uvicorn closes idle connections first, and a zero wait would time out (and log an error)
        # before even that is seen.
        self.server.config.timeout_graceful_shutdown = max(MIN_SHUTDOWN_SECONDS, grace)
        await self.server.shutdown(sockets=[self.socket])
        log.info("stopped HTTP on %s", self.url)


async def start_http_server(app, host: str, port: int, tls: dict[str, str | None] | None,
                            keep_alive_s: float) -> HttpServer:
    """Serve `app` (ASGI) on host:port (0: a free port) on the running event loop. tls: {"certfile", "keyfile",
    "client_ca"} PEM paths (client_ca None: no client certificate asked for; else one it signed is required).
    keep_alive_s: how long an idle connection stays open (GatewayOptions.http_keep_alive_s)."""
    ssl_options: dict = {}
    if tls is not None:
        ssl_options = {"ssl_certfile": tls["certfile"], "ssl_keyfile": tls["keyfile"]}
        if tls.get("client_ca"):
            ssl_options |= {"ssl_ca_certs": tls["client_ca"], "ssl_cert_reqs": ssl.CERT_REQUIRED}
    config = uvicorn.Config(app, host=host, port=port, loop="none", lifespan="off", ws="none", log_config=None,
                            access_log=False, server_header=False, timeout_keep_alive=keep_alive_s,
                            **ssl_options)
    try:
        config.load()  # builds the SSL context: a bad certificate or key fails here
    except (OSError, ssl.SSLError) as exc:
        raise OSError(f"HTTP TLS: cannot load the certificate, key or client CA: {exc}") from exc
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)
    sock = _bind(host, port)
    try:
        await server.startup(sockets=[sock])
    except BaseException:
        sock.close()
        raise
    task = asyncio.create_task(server.main_loop(), name="tandem-http")
    http = HttpServer(server, sock, task)
    log.info("serving the OpenAI-compatible API on %s/v1", http.url)
    return http
