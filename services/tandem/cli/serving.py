"""The gateway's own flags and running it until SIGTERM: shared by `tandem serve` (which builds the engines) and
`tandem gateway` (which attaches to shared pools)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import logging
from typing import TYPE_CHECKING

from tandem.cli.options import field_as_option
from tandem.cli.redis_options import add_redis_options, session_store_url
from tandem.core.config import TARGET_TOKEN_ALLOWANCE_S, EngineConfig
from tandem.errors import InvalidArgument, TandemError
from tandem.gateway.options import GatewayOptions, check_tls_files
from tandem.gateway.run import serve
from tandem.gateway.server import Loader
from tandem.gateway.validate import GatewayLimits
from tandem.telemetry import tracing
from tandem.telemetry.metrics import DEFAULT_PORT as DEFAULT_METRICS_PORT

if TYPE_CHECKING:
    from tandem.canary.config import CanaryOptions
    from tandem.canary.plugin import CanaryArms
    from tandem.gateway.handles import SessionStore

DEFAULT_HTTP_PORT = 8000  # vLLM's and most OpenAI-compatible servers' default


def add_gateway_options(parser: argparse.ArgumentParser) -> None:
    """The flags of the gRPC gateway itself, shared by `tandem serve` and `tandem gateway`."""
    add_redis_options(parser)
    parser.add_argument("--host", default=GatewayOptions().host, help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=GatewayOptions().port,
                        help="0 picks a free port (default: %(default)s)")
    parser.add_argument("--http-port", type=int, default=None,
                        help="OpenAI-compatible HTTP API (chat completions, completions, responses, batches, "
                             "/tokenize) on --host "
                             f"(default: {DEFAULT_HTTP_PORT}, or a free port when taken; 0: a free port; -1: off)")
    parser.add_argument("--http-keep-alive", type=float, default=GatewayOptions().http_keep_alive_s, metavar="SECONDS",
                        help="how long the HTTP API keeps an idle connection open: above the idle timeout of any "
                             "proxy or load balancer in front (AWS ALB and nginx 60 s; Google Cloud's 600 s: give "
                             "620), or its POSTs on a connection closed first fail as 502s (default: %(default)s)")
    parser.add_argument("--sse-ping", type=float, default=GatewayOptions().sse_ping_s, metavar="SECONDS",
                        help="an HTTP stream silent this long (waiting for a place, a long prefill) sends an SSE "
                             "comment, so that proxies that cut idle reads (nginx and AWS ALB after 60 s) keep it; "
                             "0: none (default: %(default)s)")
    parser.add_argument("--max-queue", type=int, default=GatewayOptions().max_requests,
                        help="requests queued, running, or finished with output their clients have not read yet, "
                             "before RESOURCE_EXHAUSTED (default: %(default)s)")
    parser.add_argument("--max-batch", type=int, default=EngineConfig().max_batch,
                        help="sequences per engine step (default: %(default)s)")
    parser.add_argument("--lanes", type=int, default=1,
                        help="engines over the same Ray workers, so one lane's rows draft while another's verify "
                             "(a lane takes requests once the lanes before it run --max-batch; not with --in-process "
                             "or with --tp > 1 under tandem serve; default: %(default)s)")
    parser.add_argument("--prefill-chunk", type=int, default=EngineConfig().prefill_chunk,
                        help="while others decode or start, prefill a longer prompt at most this many tokens per "
                             "step (0: a prompt at once; default: %(default)s)")
    parser.add_argument("--max-prefill-tokens", type=int, default=EngineConfig().max_prefill_tokens, metavar="N",
                        help="prefill at most N tokens of a prompt per step even when nothing else runs, so a "
                             "request arriving during a long prompt's prefill (or an abort) waits one such chunk, "
                             "not the whole prompt (0: no cap; default: %(default)s)")
    parser.add_argument("--max-tokens-limit", type=int, default=GatewayLimits().max_tokens,
                        help="largest max_tokens a request may ask for (default: %(default)s)")
    parser.add_argument("--default-max-tokens", type=int, default=GatewayLimits().default_max_tokens,
                        help="max_tokens of a request that sends none (at most --max-tokens-limit), or what its "
                             "prompt leaves of the context window if fewer (default: %(default)s)")
    parser.add_argument("--max-prompt-tokens", type=int, default=GatewayLimits().max_prompt_tokens,
                        help="longest prompt in tokens (default: %(default)s)")
    parser.add_argument("--grace", type=float, default=GatewayOptions().grace,
                        help="seconds in-flight requests may run on after SIGTERM (default: %(default)s)")
    parser.add_argument("--stall-timeout", type=float, default=GatewayOptions().stall_timeout,
                        help=f"seconds one engine step may run, plus {TARGET_TOKEN_ALLOWANCE_S:g} s a token its "
                             "forward computes (a long prompt prefilled whole), before in-flight requests fail "
                             "UNAVAILABLE and readiness turns NOT_SERVING until it ends (default: %(default)s)")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help=f"Prometheus /metrics port on --host (default: {DEFAULT_METRICS_PORT}, or a free port "
                        "when taken; 0: a free port; -1: off)")
    parser.add_argument("--no-metrics", action="store_true", help="serve no Prometheus metrics (gateway and workers)")
    parser.add_argument("--tls-cert", default=None, metavar="FILE",
                        help="serve gRPC and HTTP over TLS with this PEM certificate (chain); needs --tls-key")
    parser.add_argument("--tls-key", default=None, metavar="FILE", help="the PEM private key of --tls-cert")
    parser.add_argument("--tls-client-ca", default=None, metavar="FILE",
                        help="mutual TLS: clients must present a certificate signed by this PEM CA")
    parser.add_argument("--api-keys", default=None, metavar="FILE",
                        help="require an API key (`authorization: Bearer <key>`) on every call but health checks; "
                             "FILE maps key hashes to tenants (`tandem keys create`)")
    parser.add_argument("--insecure", action="store_true",
                        help="allow a --host beyond loopback without --api-keys (anyone who reaches it may call)")
    parser.add_argument("--tenant-queue-share", type=float, default=GatewayOptions().tenant_queue_share,
                        help="with --api-keys: the most of --max-queue one tenant may hold queued or running, so one "
                             "client cannot fill the queue (1: no cap; default: %(default)s)")
    parser.add_argument("--response-ttl", type=float, default=GatewayOptions().response_ttl_s, metavar="SECONDS",
                        help="how long a Responses API response (for GET /v1/responses/{id}, previous_response_id "
                             "and background responses) or a conversation stays stored after its last write (in the "
                             "session store's Redis, else in memory; the Batch API's files and batches: this past "
                             "their 24-hour window; 0: store none; default: %(default)s)")
    parser.add_argument("--batch-concurrency", type=int, default=GatewayOptions().batch_concurrency, metavar="N",
                        help="requests of the Batch API's batches this gateway runs at once, beside its clients' "
                             "(0: it takes batches and leaves them to gateways that run them; default: %(default)s)")
    parser.add_argument("--allowed-origins", default="", metavar="ORIGINS",
                        help="comma-separated web origins (https://app.example.com, or *) whose pages may call the "
                             "HTTP API from a browser (CORS); none by default")
    parser.add_argument("--file-storage-bytes", type=int, default=GatewayOptions().file_storage_bytes, metavar="N",
                        help="what one tenant's uploaded files (the Batch API's) may hold, all together, in the "
                             "session store's Redis; an upload past it is refused (413; default: %(default)s)")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def gateway_options(args: argparse.Namespace) -> GatewayOptions:
    if not 0 <= args.port <= 65535:
        raise InvalidArgument(f"port: must be between 0 and 65535, got {args.port}")
    if args.max_queue < 1:
        raise InvalidArgument(f"max_queue: must be at least 1, got {args.max_queue}")
    if args.lanes < 1:
        raise InvalidArgument(f"lanes: must be at least 1, got {args.lanes}")
    if args.grace < 0:
        raise InvalidArgument(f"grace: must be non-negative, got {args.grace}")
    if args.stall_timeout <= 0:
        raise InvalidArgument(f"stall_timeout: must be positive, got {args.stall_timeout}")
    try:
        limits = GatewayLimits(max_tokens=args.max_tokens_limit, default_max_tokens=args.default_max_tokens,
                               max_prompt_tokens=args.max_prompt_tokens)
    except InvalidArgument as exc:  # its max_tokens is --max-tokens-limit's value
        raise InvalidArgument(field_as_option(str(exc), "max_tokens", "max_tokens_limit")) from None
    metrics_port = DEFAULT_METRICS_PORT if args.metrics_port is None else args.metrics_port
    if not -1 <= metrics_port <= 65535:
        raise InvalidArgument(f"metrics_port: must be between -1 (off) and 65535, got {metrics_port}")
    off = args.no_metrics or metrics_port == -1
    http_port = DEFAULT_HTTP_PORT if args.http_port is None else args.http_port
    if not -1 <= http_port <= 65535:
        raise InvalidArgument(f"http_port: must be between -1 (off) and 65535, got {http_port}")
    keys = None
    if args.api_keys is not None:
        from tandem.gateway.auth import ApiKeys

        keys = ApiKeys.load(args.api_keys)
    elif not args.insecure and not is_loopback(args.host):
        # Without keys, anyone who reaches the port may generate: only loopback unless the operator says so.
        raise InvalidArgument(f"host: {args.host} is reachable beyond this machine and no --api-keys were given; "
                              "pass --api-keys FILE (`tandem keys create`), or --insecure to serve it unauthenticated")
    origins = tuple(origin.strip() for origin in args.allowed_origins.split(",") if origin.strip())
    if "*" in origins and keys is None and not args.insecure:
        # Any page a user of this machine opens could then call it and read what it stores (files, responses).
        raise InvalidArgument("allowed_origins: * without --api-keys lets any web page call this server and read "
                              "what it stores; pass --api-keys FILE, name the origins, or --insecure")
    options = GatewayOptions(host=args.host, port=args.port, limits=limits, max_requests=args.max_queue,
                             stall_timeout=args.stall_timeout, grace=args.grace,
                             metrics_port=None if off else metrics_port,
                             metrics_port_fallback=args.metrics_port is None,
                             http_port=None if http_port == -1 else http_port,
                             http_port_fallback=args.http_port is None,
                             http_keep_alive_s=args.http_keep_alive, sse_ping_s=args.sse_ping,
                             tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca,
                             api_keys=keys, tenant_queue_share=args.tenant_queue_share,
                             response_ttl_s=args.response_ttl, batch_concurrency=args.batch_concurrency,
                             file_storage_bytes=args.file_storage_bytes,
                             allowed_origins=origins)
    if options.tls:
        check_tls_files(options)  # now, before Ray or the models start
    return options


def session_store(url: str | None, stack: contextlib.ExitStack) -> SessionStore:
    """The store at `url` (credentials folded in: session_store_url), else in an embedded Redis of our own."""
    from tandem.sessions import EmbeddedRedis, open_session_store

    if not url:
        try:
            redis = stack.enter_context(EmbeddedRedis())
        except RuntimeError as exc:
            logging.getLogger(__name__).warning("no Redis: keeping session state in memory (%s)", exc)
            return open_session_store(None)
        redis.supervise()  # a redis-server killed (OOM) is started again: the store reconnects to its URL
        url = redis.url
        print(f"tandem: session state in embedded Redis at {redis.redacted_url}", flush=True)
    return open_session_store(url)


def serve_gateway(args: argparse.Namespace, load: Loader, options: GatewayOptions, canary: CanaryOptions | None,
                  exporters: list[str], model: str) -> int:
    """Run the gRPC gateway over the backends `load()` returns until SIGTERM/SIGINT (with the session store).
    canary: split sessions over the arms `load()` returns (tandem.canary.plugin; None: one backend)."""

    security = ("mutual TLS" if options.tls_client_ca else "TLS") if options.tls else "plaintext"
    if options.api_keys is not None:
        security += f", {len(options.api_keys)} API keys"

    def announce(address: str) -> None:
        # The address stays bare (HOST:PORT, what clients take): scripts read it from this line.
        print(f"tandem: serving tandem.v1.GenerationService on {address} ({security}; readiness turns SERVING once "
              f"{model} is loaded)", flush=True)

    def announce_metrics(url: str) -> None:
        print(f"tandem: Prometheus metrics at {url}", flush=True)

    def announce_http(url: str) -> None:
        print(f"tandem: serving the OpenAI-compatible HTTP API on {url}/v1", flush=True)

    def announce_ready(seconds: float) -> None:
        print(f"tandem: ready: {model} loaded, readiness SERVING ({seconds:.0f} s after start)", flush=True)

    with contextlib.ExitStack() as stack:
        sessions = session_store(session_store_url(args), stack)
        stack.callback(tracing.shutdown)  # flushes the last spans
        if exporters:
            print(f"tandem: tracing on, exporting to {', '.join(exporters)} (OTEL_* variables)", flush=True)
        try:
            arm_routers = None
            if canary is not None:
                arm_routers = _canary_arms(canary, sessions)
                print(f"tandem: canary arms {', '.join(f'{arm.name}={arm.weight:g}' for arm in canary.arms)} "
                      f"(deployment {canary.deployment}; `tandem canary status`)", flush=True)
            asyncio.run(serve(load, options, sessions=sessions, on_listening=announce, on_metrics=announce_metrics,
                              on_http=announce_http, on_ready=announce_ready, arm_routers=arm_routers))
        except OSError as exc:
            raise TandemError(str(exc)) from exc
    return 0


def _canary_arms(canary: CanaryOptions, sessions: SessionStore) -> CanaryArms:
    """The canary plug-in; its replicas share the arms' weights and observations through the sessions' Redis."""
    from tandem.canary.plugin import CanaryArms
    from tandem.sessions import RedisSessionStore

    return CanaryArms(canary, sessions.url if isinstance(sessions, RedisSessionStore) else None)
