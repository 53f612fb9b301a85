"""The gateway's gRPC server: Generation, grpc.health.v1 and reflection, with loading and draining phases.

Liveness ("" in grpc.health.v1) is SERVING as soon as the port is bound. Readiness ("tandem.v1.GenerationService") is
NOT_SERVING while the engine loads, SERVING once it can take requests, and NOT_SERVING again while draining.

With canary options (tandem.canary), the loader returns {arm name: Backend}: one EngineLoop per arm, readiness once
every arm has loaded, and a CanaryController that routes each session to an arm.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.errors import InvalidArgument, TandemError
from tandem.gateway.auth import ApiKeys
from tandem.gateway.generation import Backend, Generations
from tandem.gateway.lanes import LanedLoop, ServingLoop
from tandem.gateway.loop import EngineLoop, SessionStore
from tandem.gateway.servicer import AuthInterceptor, GenerationServiceServicer, add_to_server
from tandem.gateway.validate import GatewayLimits
from tandem.telemetry.metrics import GatewayMetrics
from tandem.v1 import generation_pb2

log = logging.getLogger(__name__)

READINESS_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
LIVENESS_SERVICE = ""
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
DRAIN_POLL_SECONDS = 0.05
BACKEND_POLL_SECONDS = 1.0  # while no target replica answers: how often the gateway probes them


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
    # TLS on the gRPC and HTTP ports (PEM files; both or neither). tls_client_ca: mutual TLS, clients must present a
    # certificate it signed. Prometheus /metrics stays plaintext: scrapers sit inside the cluster's network.
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    api_keys: ApiKeys | None = None  # None: no keys asked for, every caller is tenant ""
    # With API keys: the most of max_requests one tenant may hold queued or running, so one client cannot fill the
    # queue for the others (1.0: no cap beyond each key's max_concurrency).
    tenant_queue_share: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 < self.tenant_queue_share <= 1.0:
            raise InvalidArgument(f"tenant_queue_share: must be in (0, 1], got {self.tenant_queue_share}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise InvalidArgument("tls: give both a certificate (--tls-cert) and its key (--tls-key), or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise InvalidArgument("tls_client_ca: mutual TLS needs --tls-cert and --tls-key too")

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None


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


class Gateway:
    """A started server; the engine loads in the background (see `ready`)."""

    def __init__(self, server: grpc.aio.Server, health_servicer: health.aio.HealthServicer,
                 servicer: GenerationServiceServicer, options: GatewayOptions, port: int) -> None:
        self.server, self.health, self.servicer = server, health_servicer, servicer
        self.generations: Generations = servicer.generations  # the generate path every transport shares
        self.metrics: GatewayMetrics | None = self.generations.metrics
        self.options = options
        self.port = port
        self.loop: ServingLoop | None = None  # the baseline arm's loop with canary arms
        self.loops: dict[str, ServingLoop] = {}  # canary arms: every arm's loop (empty without a canary)
        self.canary = None  # tandem.canary.CanaryController while serving canary arms
        self.canary_options = None  # tandem.canary.config.CanaryOptions: serve arms
        self.loading: asyncio.Task | None = None
        self._drain: asyncio.Task | None = None
        self._backend_watch: asyncio.Task | None = None
        self.http = None  # tandem.gateway.openai.server.HttpServer while the OpenAI-compatible HTTP API is on

    @property
    def address(self) -> str:
        return format_address(self.options.host, self.port)

    @property
    def metrics_url(self) -> str | None:
        """Where Prometheus scrapes this gateway (None: metrics off)."""
        return self.metrics.url if self.metrics is not None else None

    @property
    def draining(self) -> bool:
        return self._drain is not None

    @property
    def http_port(self) -> int | None:
        """The HTTP API's bound port (None: off)."""
        return self.http.port if self.http is not None else None

    @property
    def http_url(self) -> str | None:
        return self.http.url if self.http is not None else None

    def http_status(self) -> str | None:
        """Why the HTTP API cannot take requests now, or None when it can: the gRPC readiness, in words."""
        if self._drain is not None:
            return "draining"
        if self.loop is None:
            return "loading"
        return "unavailable" if any(loop.unavailable for loop in self.all_loops) else None

    async def _start_http(self) -> None:
        from tandem.gateway.openai.app import create_app
        from tandem.gateway.openai.server import start_http_server

        options = self.options
        ports = [options.http_port, 0] if options.http_port_fallback else [options.http_port]
        app = create_app(self.generations, self.http_status, options.api_keys)
        tls = {"certfile": options.tls_cert, "keyfile": options.tls_key, "client_ca": options.tls_client_ca} \
            if options.tls else None
        for index, port in enumerate(ports):
            try:
                self.http = await start_http_server(app, options.host, port, tls)
                return
            except OSError:
                if index == len(ports) - 1:
                    raise
                log.info("HTTP port %d is taken; serving the HTTP API on a free port", port)

    async def ready(self) -> bool:
        """Wait for the engine to load: True once serving, False if a drain cut loading short; re-raises failures."""
        if self.loading is None:
            return self.loop is not None
        await asyncio.wait([self.loading])
        if self.loading.cancelled():
            return False
        self.loading.result()
        return True

    async def _load(self, load: Callable[[], Backend | Mapping[str, Backend]],
                    sessions: SessionStore | None) -> None:
        loops: dict[str, ServingLoop] = {}
        try:
            loaded = await asyncio.to_thread(load)
            backends = self._arm_backends(loaded)
            baseline = next(iter(backends))
            for name, backend in backends.items():
                loop = self._loop_for(backend, sessions)
                if self.metrics is not None:
                    loop.metrics = self.metrics
                    if name == baseline:
                        self.metrics.attach(loop, backend.target_name, backend.draft_name)
                await loop.start()
                loops[name] = loop
            canary = None
            if self.canary_options is not None:
                canary = await asyncio.to_thread(self._start_canary, sessions, set(backends))
                from tandem.canary.greedy_check import GreedyChecker, loop_reference

                opts = self.canary_options
                if opts.greedy_check_rate > 0:
                    canary.greedy = GreedyChecker(loop_reference(loops[baseline], asyncio.get_running_loop()),
                                                  rate=opts.greedy_check_rate, max_tokens=opts.greedy_check_tokens)
        except Exception as exc:
            for started in loops.values():
                await started.close()
            if isinstance(exc, TandemError):  # a user-facing message; whoever awaits ready() reports it
                log.info("loading the engine failed: %s", exc)
            else:
                log.exception("loading the engine failed")
            await self.health.set(LIVENESS_SERVICE, NOT_SERVING)
            raise
        backend, loop = backends[baseline], loops[baseline]
        self.loop, self.canary = loop, canary
        if self.canary_options is not None:
            self.loops = loops
        self.generations.attach(backend, loop, self.loops, canary)
        self._backend_watch = asyncio.create_task(self._watch_backends())
        if self._drain is None:
            await self.health.set(READINESS_SERVICE, SERVING)
            arms = f" (canary arms {', '.join(loops)})" if self.canary_options is not None else ""
            log.info("ready: %s on %s%s", backend.target_name, self.address, arms)

    async def _watch_backends(self) -> None:
        """Readiness follows the target replicas: NOT_SERVING while no replica of a loop answers (its requests fail
        UNAVAILABLE), SERVING again once one does."""
        down = False
        while self._drain is None:
            await asyncio.sleep(BACKEND_POLL_SECONDS)
            loops = [loop for loop in self.all_loops if loop.unavailable]
            if loops and not down:
                log.warning("readiness NOT_SERVING: no target replica is available")
                await self.health.set(READINESS_SERVICE, NOT_SERVING)
            recovered = [await asyncio.to_thread(loop.recover, BACKEND_POLL_SECONDS) for loop in loops]
            down = not all(recovered)
            if loops and not down and self._drain is None:
                log.warning("readiness SERVING: a target replica answers again")
                await self.health.set(READINESS_SERVICE, SERVING)

    def _loop_for(self, backend: Backend, sessions: SessionStore | None) -> ServingLoop:
        options = self.options
        loops = [EngineLoop(engine, options.max_requests, options.stall_timeout, sessions)
                 for engine in backend.engines]
        if len(loops) == 1:
            return loops[0]
        for index, loop in enumerate(loops):
            loop.thread_name = f"tandem-engine-{index}"
        return LanedLoop(loops, options.max_requests)

    def _arm_backends(self, loaded: Backend | Mapping[str, Backend]) -> dict[str, Backend]:
        """{arm: Backend}, the baseline first; a plain Backend without a canary ("" names it)."""
        if self.canary_options is None:
            if not isinstance(loaded, Backend):
                raise TandemError("the loader returned canary arms, but the gateway has no canary options")
            return {"": loaded}
        if not isinstance(loaded, Mapping) or not loaded:
            raise TandemError("canary: the loader must return {arm name: Backend}")
        names = [arm.name for arm in self.canary_options.arms]
        if missing := [name for name in names if name not in loaded]:
            raise TandemError(f"canary: no backend for arms {missing}")
        return {name: loaded[name] for name in names}  # configured order: the first arm is the baseline

    def _start_canary(self, sessions: SessionStore | None, served: set[str]):
        from tandem.canary.config import start_controller
        from tandem.sessions.store import RedisSessionStore

        url = sessions.url if isinstance(sessions, RedisSessionStore) else None  # arms' weights shared via Redis
        meter = self.metrics.endpoint.provider.get_meter("tandem.canary") if self.metrics is not None else None
        return start_controller(self.canary_options, url, served=served, meter=meter)

    @property
    def all_loops(self) -> list[ServingLoop]:
        return list(self.loops.values()) if self.loops else ([self.loop] if self.loop is not None else [])

    def drain(self, grace: float | None = None) -> asyncio.Task:
        """Stop taking requests, let in-flight ones finish for up to `grace` seconds, then stop (idempotent)."""
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._drain_and_stop(self.options.grace if grace is None else grace))
        return self._drain

    async def _drain_and_stop(self, grace: float) -> None:
        deadline = time.monotonic() + grace
        if self._backend_watch is not None:
            self._backend_watch.cancel()
        await self.health.set(READINESS_SERVICE, NOT_SERVING)
        loops = self.all_loops
        if loops:
            for loop in loops:
                loop.draining = True
            log.info("draining %d requests (grace %.1fs)", sum(loop.active for loop in loops), grace)
            while any(loop.active for loop in loops) and time.monotonic() < deadline:
                await asyncio.sleep(DRAIN_POLL_SECONDS)
        await self.health.enter_graceful_shutdown()
        remaining = max(0.0, deadline - time.monotonic())
        await asyncio.gather(self.server.stop(remaining), *([self.http.stop(remaining)] if self.http else []))
        if self.loading is not None and not self.loading.done():
            self.loading.cancel()
        if self.canary is not None:  # flushes the last observations; pending greedy checks end with the loops
            await asyncio.to_thread(self.canary.close)
        for loop in self.all_loops:
            await loop.close()
        if self.metrics is not None:
            await asyncio.to_thread(self.metrics.close)
        log.info("stopped %s", self.address)

    async def wait_closed(self) -> None:
        await self.server.wait_for_termination()
        if self._drain is not None:
            await self._drain


async def start_gateway(load: Callable[[], Backend | Mapping[str, Backend]], options: GatewayOptions | None = None,
                        sessions: SessionStore | None = None, canary=None) -> Gateway:
    """Bind and start the server now; `load` (run in a thread) builds the engine while health reports loading.
    canary: tandem.canary.config.CanaryOptions; `load` then returns {arm name: Backend} (the first arm the baseline)."""
    options = options or GatewayOptions()
    credentials = grpc_server_credentials(options) if options.tls else None  # unreadable files fail before binding
    interceptors = [AuthInterceptor(options.api_keys)] if options.api_keys is not None else []
    # SO_REUSEPORT off: a second server on a busy port must fail rather than silently share it.
    # A message past max_request_bytes is refused (RESOURCE_EXHAUSTED) before it is parsed.
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0),
                                      ("grpc.max_receive_message_length", options.limits.max_request_bytes)],
                             interceptors=interceptors)
    metrics = None
    if options.metrics_port is not None:
        ports = [options.metrics_port, 0] if options.metrics_port_fallback else [options.metrics_port]
        metrics = GatewayMetrics(options.host, ports)
    generations = Generations(options.limits, metrics)
    if options.api_keys is not None:
        generations.tenant_limits = {name: tenant.max_concurrency for name, tenant in options.api_keys.tenants.items()
                                     if tenant.max_concurrency is not None}
        generations.tenant_queue_share = options.tenant_queue_share
    servicer = GenerationServiceServicer(generations, options.api_keys)
    add_to_server(servicer, server)  # generation_pb2_grpc's registration, malformed requests INVALID_ARGUMENT
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((READINESS_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = format_address(options.host, options.port)
    try:
        port = server.add_secure_port(address, credentials) if credentials is not None \
            else server.add_insecure_port(address)
    except RuntimeError as exc:
        if metrics is not None:
            metrics.close()
        raise OSError(f"cannot listen on {address}: {exc}") from exc
    await health_servicer.set(LIVENESS_SERVICE, SERVING)
    await health_servicer.set(READINESS_SERVICE, NOT_SERVING)
    await server.start()
    gateway = Gateway(server, health_servicer, servicer, options, port)
    if options.http_port is not None:
        try:
            await gateway._start_http()
        except BaseException:
            await server.stop(0)
            if metrics is not None:
                metrics.close()
            raise
    gateway.canary_options = canary
    gateway.loading = asyncio.create_task(gateway._load(load, sessions))
    return gateway


async def serve(load: Callable[[], Backend | Mapping[str, Backend]], options: GatewayOptions,
                sessions: SessionStore | None = None, on_listening: Callable[[str], None] | None = None,
                on_metrics: Callable[[str], None] | None = None, canary=None,
                on_http: Callable[[str], None] | None = None) -> None:
    """Run until SIGTERM or SIGINT, then drain gracefully. on_http: told the HTTP API's base URL when it is on."""
    gateway = await start_gateway(load, options, sessions, canary)
    if on_metrics is not None and gateway.metrics_url is not None:
        on_metrics(gateway.metrics_url)
    if on_listening is not None:
        on_listening(gateway.address)
    if on_http is not None and gateway.http_url is not None:
        on_http(gateway.http_url)
    stopping: list[asyncio.Task] = []

    def on_signal() -> None:
        if gateway.draining:  # a second signal: cancel what is still running and stop now
            stopping.append(asyncio.ensure_future(gateway.server.stop(0)))
        else:
            gateway.drain()

    event_loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        event_loop.add_signal_handler(signum, on_signal)
    try:
        await gateway.ready()
    except Exception:
        await gateway.drain(0)
        raise
    await gateway.wait_closed()
