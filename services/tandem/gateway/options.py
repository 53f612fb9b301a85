"""A gateway's settings: where it listens, its limits and phases, TLS, API keys and tenants' share of the queue."""

from __future__ import annotations

import re
import ssl
from dataclasses import dataclass, field

import grpc

from tandem.errors import InvalidArgument
from tandem.gateway.auth import ApiKeys
from tandem.gateway.validate import GatewayLimits

KEEPALIVE_TIMEOUT_S = 20.0  # a gateway's keepalive ping unanswered this long: the connection is gone
ORIGIN = re.compile(r"https?://[^/\s:]+(:\d{1,5})?")  # what a browser sends as Origin


@dataclass(slots=True, frozen=True)
class GatewayOptions:
    host: str = "127.0.0.1"
    port: int = 50051
    limits: GatewayLimits = field(default_factory=GatewayLimits)
    max_requests: int = 256
    stall_timeout: float = 60.0
    grace: float = 30.0
    metrics_port: int | None = None  # Prometheus /metrics on the gateway's host: None = off, 0 = any free port
    metrics_port_fallback: bool = False  # when metrics_port is taken, use any free port instead of failing
    http_port: int | None = None  # the OpenAI-compatible HTTP API on the gateway's host: None = off, 0 = any free port
    http_port_fallback: bool = False  # when http_port is taken, use any free port instead of failing
    # How long the HTTP API keeps an idle connection open. Proxies and load balancers pool connections to a backend
    # and reuse one idle up to their own timeout (AWS ALB and nginx 60 s); a POST sent on one the backend closed
    # first comes back as a 502 or 503, not retried. uvicorn's default, 5 s, is under every such timeout.
    http_keep_alive_s: float = 75.0
    # An HTTP stream that sends nothing for this long sends an SSE comment: proxies cut a response that sends nothing
    # for their read timeout (nginx and AWS ALB 60 s), and a wait for a place or a long prefill on a CPU lasts longer.
    # 0: none (and a stream's headers wait for its first event however long it takes).
    sse_ping_s: float = 15.0
    # gRPC keepalive. A client may ping as often as every grpc_client_ping_s (production clients ping every 10-30 s so
    # that a proxy or NAT keeps the connection): under gRPC's own default, 5 minutes, a client pinging during a stream
    # that sends nothing for a while (a long prefill on a CPU, a wait for a place) was sent GOAWAY too_many_pings and
    # its stream failed UNAVAILABLE. The gateway pings each connection every grpc_keepalive_s, so that a client gone
    # without closing its connection is noticed (its requests then end) and a silent stream's path stays open.
    grpc_client_ping_s: float = 5.0
    grpc_keepalive_s: float = 30.0
    # TLS on the gRPC and HTTP ports (PEM files; both or neither). tls_client_ca: mutual TLS, clients must present a
    # certificate it signed. Prometheus /metrics stays plaintext: scrapers sit inside the cluster's network.
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    api_keys: ApiKeys | None = None  # None: no keys asked for, every caller is tenant ""
    # With API keys: the most of max_requests one tenant may hold queued or running, so one client cannot fill the
    # queue for the others (1.0: no cap beyond each key's max_concurrency).
    tenant_queue_share: float = 0.5
    # How long a stored Responses API response can be read or continued (previous_response_id); 0: none stored.
    response_ttl_s: float = 3600.0
    # Requests of the Batch API's batches this gateway runs at once (0: it stores batches and leaves them to others).
    batch_concurrency: int = 8
    # What one tenant's uploaded files (the Batch API's) may hold in the shared store, all together.
    file_storage_bytes: int = 1 << 30
    # Web origins whose pages may call the HTTP API from a browser (CORS; "*": any). None by default: without API
    # keys, any page a user of this machine opens could otherwise read what the server stores (files, responses).
    allowed_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not (self.grpc_client_ping_s > 0 and self.grpc_keepalive_s > 0):
            raise InvalidArgument("grpc keepalive: the intervals must be positive seconds")
        if not self.http_keep_alive_s > 0:
            raise InvalidArgument(f"http_keep_alive: must be positive seconds, got {self.http_keep_alive_s}")
        if not self.sse_ping_s >= 0:
            raise InvalidArgument(f"sse_ping: must be >= 0 seconds (0: no pings), got {self.sse_ping_s}")
        if self.file_storage_bytes < 1:
            raise InvalidArgument(f"file_storage_bytes: must be positive, got {self.file_storage_bytes}")
        if self.batch_concurrency < 0:
            raise InvalidArgument(f"batch_concurrency: must be >= 0 (0: run no batches here), got "
                                  f"{self.batch_concurrency}")
        if self.response_ttl_s < 0:
            raise InvalidArgument(f"response_ttl: must be >= 0 seconds (0: store no responses), got "
                                  f"{self.response_ttl_s}")
        if not 0.0 < self.tenant_queue_share <= 1.0:
            raise InvalidArgument(f"tenant_queue_share: must be in (0, 1], got {self.tenant_queue_share}")
        for origin in self.allowed_origins:
            if origin != "*" and not ORIGIN.fullmatch(origin):
                raise InvalidArgument(f"allowed_origins: {origin!r} is not an origin (scheme://host[:port], or *)")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise InvalidArgument("tls: give both a certificate (--tls-cert) and its key (--tls-key), or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise InvalidArgument("tls_client_ca: mutual TLS needs --tls-cert and --tls-key too")

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def grpc_keepalive(self) -> list[tuple[str, int]]:
        """The gRPC server's keepalive options: pings from clients at grpc_client_ping_s or longer, with calls or
        without; its own every grpc_keepalive_s, through streams that send nothing (an unanswered one within
        KEEPALIVE_TIMEOUT_S closes the connection)."""
        return [("grpc.http2.min_ping_interval_without_data_ms", int(self.grpc_client_ping_s * 1000)),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.keepalive_time_ms", int(self.grpc_keepalive_s * 1000)),
                ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
                ("grpc.http2.ping_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),  # (what times a ping's ack now)
                ("grpc.http2.max_pings_without_data", 0)]


def _read_pem(name: str, path: str) -> bytes:
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as exc:
        raise InvalidArgument(f"{name}: cannot read {path}: {exc.strerror or exc}") from exc


def check_tls_files(options: GatewayOptions) -> None:
    """Load the files as Python's ssl would: a bad PEM or a key that is not the certificate's fails here with its
    reason (grpc only reports "Failed to bind" for them)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(options.tls_cert, options.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise InvalidArgument(f"tls_cert: cannot use {options.tls_cert} with the key {options.tls_key}: {exc}") \
            from exc
    if options.tls_client_ca is not None:
        try:
            context.load_verify_locations(options.tls_client_ca)
        except (OSError, ssl.SSLError) as exc:
            raise InvalidArgument(f"tls_client_ca: cannot use {options.tls_client_ca}: {exc}") from exc


def grpc_server_credentials(options: GatewayOptions) -> grpc.ServerCredentials:
    """TLS credentials for the gRPC port; with a client CA, a client without a certificate it signed is refused in
    the handshake."""
    pair = (_read_pem("tls_key", options.tls_key), _read_pem("tls_cert", options.tls_cert))
    check_tls_files(options)
    if options.tls_client_ca is None:
        return grpc.ssl_server_credentials([pair])
    return grpc.ssl_server_credentials([pair], root_certificates=_read_pem("tls_client_ca", options.tls_client_ca),
                                       require_client_auth=True)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
