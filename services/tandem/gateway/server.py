"""The gateway's gRPC server: Generation, grpc.health.v1 and reflection, with loading and draining phases.

Liveness ("" in grpc.health.v1) is SERVING as soon as the port is bound. Readiness ("tandem.v1.GenerationService") is
NOT_SERVING while the engines load, SERVING once they can take requests, and NOT_SERVING again while draining.

The engines load in the background: `load` (run in a thread) returns a Backend, or {arm name: Backend} with the
baseline first. Once they have loaded, the gateway starts one serving loop per arm, starts the arm router it was
given (gateway.arms), and builds its generate path (gateway.generation); until then generate calls are UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.engines import Backend
from tandem.gateway.arms import ArmRouter, ArmRouterFactory
from tandem.gateway.events import NOT_LOADED, EngineUnavailable
from tandem.gateway.generation import Generations
from tandem.gateway.handles import SessionStore
from tandem.gateway.http_api import HttpApi
from tandem.gateway.lanes import ServingLoop
from tandem.gateway.loading import load_generations
from tandem.gateway.options import GatewayOptions, format_address
from tandem.gateway.registration import AuthInterceptor, add_to_server
from tandem.gateway.servicer import GenerationServiceServicer
from tandem.telemetry.metrics import GatewayMetrics
from tandem.v1 import generation_pb2

if TYPE_CHECKING:
    from tandem.gateway.openai.background import BackgroundResponses
    from tandem.gateway.openai.batches import Batches
    from tandem.gateway.openai.conversations import ConversationStore
    from tandem.gateway.openai.files import FileStore
    from tandem.gateway.openai.server import HttpServer
    from tandem.gateway.openai.stored import ResponseStore

log = logging.getLogger(__name__)

READINESS_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
LIVENESS_SERVICE = ""
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
DRAIN_POLL_SECONDS = 0.05
BACKEND_POLL_SECONDS = 1.0  # while no target replica answers: how often the gateway probes them
IDLE_PROBE_SECONDS = 5.0  # while they answer and no request runs: how often it asks (each may take as long to answer)

Loader = Callable[[], Backend | Mapping[str, Backend]]


class Gateway(HttpApi):
    """A gRPC server bound to its port with every service registered; `start` serves and loads the engines in the
    background (see `ready`)."""

    def __init__(self, options: GatewayOptions, credentials: grpc.ServerCredentials | None = None,
                 metrics: GatewayMetrics | None = None, sessions: SessionStore | None = None,
                 arm_routers: ArmRouterFactory | None = None) -> None:
        """credentials: TLS for the port (None: plaintext); sessions: where session state lives (None: memory);
        arm_routers: the edge plug-in that splits requests over arms (None: one backend serves them all). Raises
        OSError when the port cannot be bound."""
        self.options, self.metrics, self.sessions, self.arm_routers = options, metrics, sessions, arm_routers
        if metrics is not None and sessions is not None:
            metrics.attach_sessions(lambda: sessions.healthy)
        self.generations: Generations | None = None  # the generate path, once the engines have loaded
        self.health = health.aio.HealthServicer()
        self.servicer = GenerationServiceServicer(self.serving, options.api_keys)
        interceptors = [AuthInterceptor(options.api_keys)] if options.api_keys is not None else []
        # SO_REUSEPORT off: a second server on a busy port must fail rather than silently share it.
        # A message past max_request_bytes is refused (RESOURCE_EXHAUSTED) before it is parsed.
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0),
                                               ("grpc.max_receive_message_length", options.limits.max_request_bytes),
                                               *options.grpc_keepalive()],
                                      interceptors=interceptors)
        add_to_server(self.servicer, self.server)  # generation_pb2_grpc's, malformed requests INVALID_ARGUMENT
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection((READINESS_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME),
                                            self.server)
        address = format_address(options.host, options.port)
        try:
            self.port = self.server.add_secure_port(address, credentials) if credentials is not None \
                else self.server.add_insecure_port(address)
        except RuntimeError as exc:
            raise OSError(f"cannot listen on {address}: {exc}") from exc
        self.http: HttpServer | None = None  # the OpenAI-compatible HTTP API, while it is on
        self.stored: ResponseStore | None = None  # the HTTP API's stored responses
        self.background: BackgroundResponses | None = None  # and the background ones it runs
        self.files: FileStore | None = None  # the Batch API's files
        self.batches: Batches | None = None  # and its batches (those running here run on this replica)
        self.conversations: ConversationStore | None = None  # and its conversations
        self.loading: asyncio.Task | None = None
        self._drain: asyncio.Task | None = None
        self._backend_watch: asyncio.Task | None = None

    def serving(self) -> Generations:
        """The generate path; EngineUnavailable while the engines load."""
        if self.generations is None:
            raise EngineUnavailable(NOT_LOADED)
        return self.generations

    @property
    def loop(self) -> ServingLoop | None:
        """The baseline arm's serving loop (None while loading)."""
        return self.generations.loop if self.generations is not None else None

    @property
    def loops(self) -> dict[str, ServingLoop]:
        """Every arm's serving loop, the baseline's first ("" names a lone backend's)."""
        return dict(self.generations.loops) if self.generations is not None else {}

    @property
    def arm_router(self) -> ArmRouter | None:
        return self.generations.arm_router if self.generations is not None else None

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
        if self.generations is None:
            return "loading"
        if any(loop.stalled for loop in self.all_loops):
            return "stalled"
        return "unavailable" if any(loop.unavailable or loop.waiting_for_replica for loop in self.all_loops) else None

    @property
    def all_loops(self) -> list[ServingLoop]:
        return list(self.generations.loops.values()) if self.generations is not None else []

    async def start(self, load: Loader) -> None:
        """Serve health now, the HTTP API when it is on, and load the engines in the background."""
        await self.health.set(LIVENESS_SERVICE, SERVING)
        await self.health.set(READINESS_SERVICE, NOT_SERVING)
        await self.server.start()
        if self.options.http_port is not None:
            try:
                await self._start_http()
            except BaseException:
                await self.server.stop(0)
                raise
        self.loading = asyncio.create_task(self._load(load))

    async def ready(self) -> bool:
        """Wait for the engines to load: True once serving, False if a drain cut loading short; re-raises failures."""
        if self.loading is None:
            return self.generations is not None
        await asyncio.wait([self.loading])
        if self.loading.cancelled():
            return False
        self.loading.result()
        return True

    async def _load(self, load: Loader) -> None:
        try:
            self.generations = await load_generations(load, self.options, self.metrics, self.sessions,
                                                      self.arm_routers)
        except Exception:
            await self.health.set(LIVENESS_SERVICE, NOT_SERVING)
            raise
        self._backend_watch = asyncio.create_task(self._watch_backends())
        if self._drain is None:
            await self.health.set(READINESS_SERVICE, SERVING)
            arms = f" (arms {', '.join(self.generations.loops)})" if self.arm_router is not None else ""
            log.info("ready: %s on %s%s", self.generations.backend.target_name, self.address, arms)

    async def _watch_backends(self) -> None:
        """Readiness follows the target replicas and the engines: NOT_SERVING while no replica of a loop answers, a
        loop's step waits for one to come back or is stalled (its requests fail UNAVAILABLE), SERVING again once one
        answers and the step ended."""
        down, probed = False, time.monotonic()
        while self._drain is None:
            await asyncio.sleep(BACKEND_POLL_SECONDS)
            if time.monotonic() - probed >= IDLE_PROBE_SECONDS:
                for loop in self.all_loops:
                    await asyncio.to_thread(loop.probe_idle, IDLE_PROBE_SECONDS)
                probed = time.monotonic()
            loops = [loop for loop in self.all_loops if loop.unavailable or loop.stalled or loop.waiting_for_replica]
            if loops and not down:
                log.warning("readiness NOT_SERVING: %s", _why_down(loops))
                await self.health.set(READINESS_SERVICE, NOT_SERVING)
                down = True
            recovered = all([await asyncio.to_thread(loop.recover, BACKEND_POLL_SECONDS) for loop in loops])
            if down and recovered and self._drain is None:  # (a loop may have recovered between two polls)
                log.warning("readiness SERVING again")
                await self.health.set(READINESS_SERVICE, SERVING)
            down = not recovered

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
        for loop in loops:  # past the grace: told while the servers still hold their connections
            loop.end_requests()
        remaining = max(0.0, deadline - time.monotonic())
        await asyncio.gather(self.server.stop(remaining), *([self.http.stop(remaining)] if self.http else []))
        if self.loading is not None and not self.loading.done():
            self.loading.cancel()
        if self.arm_router is not None:  # flushes what it recorded; its pending checks end with the loops
            await asyncio.to_thread(self.arm_router.close)
        for loop in self.all_loops:
            await loop.close()
        if self.generations is not None:
            await self.generations.registry.close()
        if self.metrics is not None:
            await asyncio.to_thread(self.metrics.close)
        await self._close_http()
        log.info("stopped %s", self.address)

    async def wait_closed(self) -> None:
        await self.server.wait_for_termination()
        if self._drain is not None:
            await self._drain


def _why_down(loops: list[ServingLoop]) -> str:
    if any(loop.stalled for loop in loops):
        return "an engine step is stalled"
    if any(loop.waiting_for_replica for loop in loops):
        return "every target replica failed; waiting for one to come back"
    return "no target replica is available"
