"""The gateway's gRPC server: Generation, grpc.health.v1 and reflection, with loading and draining phases.

Liveness ("" in grpc.health.v1) is SERVING as soon as the port is bound. Readiness ("tandem.v1.Generation") is
NOT_SERVING while the engine loads, SERVING once it can take requests, and NOT_SERVING again while draining.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.errors import TandemError
from tandem.gateway.loop import EngineLoop, SessionStore
from tandem.gateway.servicer import Backend, GenerationServicer
from tandem.gateway.validate import GatewayLimits
from tandem.telemetry.metrics import GatewayMetrics
from tandem.v1 import generation_pb2, generation_pb2_grpc

log = logging.getLogger(__name__)

READINESS_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
LIVENESS_SERVICE = ""
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
DRAIN_POLL_SECONDS = 0.05


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


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Gateway:
    """A started server; the engine loads in the background (see `ready`)."""

    def __init__(self, server: grpc.aio.Server, health_servicer: health.aio.HealthServicer,
                 servicer: GenerationServicer, options: GatewayOptions, port: int) -> None:
        self.server, self.health, self.servicer = server, health_servicer, servicer
        self.metrics: GatewayMetrics | None = servicer.metrics
        self.options = options
        self.port = port
        self.loop: EngineLoop | None = None
        self.loading: asyncio.Task | None = None
        self._drain: asyncio.Task | None = None

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

    async def ready(self) -> bool:
        """Wait for the engine to load: True once serving, False if a drain cut loading short; re-raises failures."""
        if self.loading is None:
            return self.loop is not None
        await asyncio.wait([self.loading])
        if self.loading.cancelled():
            return False
        self.loading.result()
        return True

    async def _load(self, load: Callable[[], Backend], sessions: SessionStore | None) -> None:
        try:
            backend = await asyncio.to_thread(load)
            loop = EngineLoop(backend.engine, self.options.max_requests, self.options.stall_timeout, sessions)
            if self.metrics is not None:
                loop.metrics = self.metrics
                self.metrics.attach(loop, backend.target_name, backend.draft_name)
            await loop.start()
        except Exception as exc:
            if isinstance(exc, TandemError):  # a user-facing message; whoever awaits ready() reports it
                log.info("loading the engine failed: %s", exc)
            else:
                log.exception("loading the engine failed")
            await self.health.set(LIVENESS_SERVICE, NOT_SERVING)
            raise
        self.loop = loop
        self.servicer.attach(backend, loop)
        if self._drain is None:
            await self.health.set(READINESS_SERVICE, SERVING)
            log.info("ready: %s on %s", backend.target_name, self.address)

    def drain(self, grace: float | None = None) -> asyncio.Task:
        """Stop taking requests, let in-flight ones finish for up to `grace` seconds, then stop (idempotent)."""
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._drain_and_stop(self.options.grace if grace is None else grace))
        return self._drain

    async def _drain_and_stop(self, grace: float) -> None:
        deadline = time.monotonic() + grace
        await self.health.set(READINESS_SERVICE, NOT_SERVING)
        if self.loop is not None:
            self.loop.draining = True
            log.info("draining %d requests (grace %.1fs)", self.loop.active, grace)
            while self.loop.active and time.monotonic() < deadline:
                await asyncio.sleep(DRAIN_POLL_SECONDS)
        await self.health.enter_graceful_shutdown()
        await self.server.stop(max(0.0, deadline - time.monotonic()))
        if self.loading is not None and not self.loading.done():
            self.loading.cancel()
        if self.loop is not None:
            await self.loop.close()
        if self.metrics is not None:
            await asyncio.to_thread(self.metrics.close)
        log.info("stopped %s", self.address)

    async def wait_closed(self) -> None:
        await self.server.wait_for_termination()
        if self._drain is not None:
            await self._drain


async def start_gateway(load: Callable[[], Backend], options: GatewayOptions | None = None,
                        sessions: SessionStore | None = None) -> Gateway:
    """Bind and start the server now; `load` (run in a thread) builds the engine while health reports loading."""
    options = options or GatewayOptions()
    # SO_REUSEPORT off: a second server on a busy port must fail rather than silently share it.
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    metrics = None
    if options.metrics_port is not None:
        ports = [options.metrics_port, 0] if options.metrics_port_fallback else [options.metrics_port]
        metrics = GatewayMetrics(options.host, ports)
    servicer = GenerationServicer(options.limits, metrics)
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((READINESS_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = format_address(options.host, options.port)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:
        if metrics is not None:
            metrics.close()
        raise OSError(f"cannot listen on {address}: {exc}") from exc
    await health_servicer.set(LIVENESS_SERVICE, SERVING)
    await health_servicer.set(READINESS_SERVICE, NOT_SERVING)
    await server.start()
    gateway = Gateway(server, health_servicer, servicer, options, port)
    gateway.loading = asyncio.create_task(gateway._load(load, sessions))
    return gateway


async def serve(load: Callable[[], Backend], options: GatewayOptions, sessions: SessionStore | None = None,
                on_listening: Callable[[str], None] | None = None,
                on_metrics: Callable[[str], None] | None = None) -> None:
    """Run until SIGTERM or SIGINT, then drain gracefully."""
    gateway = await start_gateway(load, options, sessions)
    if on_metrics is not None and gateway.metrics_url is not None:
        on_metrics(gateway.metrics_url)
    if on_listening is not None:
        on_listening(gateway.address)
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
