"""Running a gateway as a process: `start_gateway` binds the /metrics port and the gateway's own and starts loading the
engines; `serve` runs it until SIGTERM or SIGINT, then drains it (a second signal stops it at once).

The server (gateway.server.Gateway) handles no signals: tests start it in their own event loop through start_gateway
and drain it themselves.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable

from tandem.core.gc_pause import freeze_loaded_heap
from tandem.gateway.arms import ArmRouterFactory
from tandem.gateway.handles import SessionStore
from tandem.gateway.options import GatewayOptions, format_address, grpc_server_credentials
from tandem.gateway.server import Gateway, Loader
from tandem.telemetry.metrics import GatewayMetrics


async def start_gateway(load: Loader, options: GatewayOptions | None = None, sessions: SessionStore | None = None,
                        arm_routers: ArmRouterFactory | None = None) -> Gateway:
    """Bind and start the server now; `load` (run in a thread) builds the engines while health reports loading.
    arm_routers: the plug-in that splits requests over the arms `load` returns (gateway.arms; the canary's is
    tandem.canary.plugin.CanaryArms)."""
    options = options or GatewayOptions()
    credentials = grpc_server_credentials(options) if options.tls else None  # unreadable files fail before binding
    metrics = None
    if options.metrics_port is not None:
        ports = [options.metrics_port, 0] if options.metrics_port_fallback else [options.metrics_port]
        try:
            metrics = GatewayMetrics(options.host, ports)
        except OSError as exc:  # named as the gRPC and HTTP ports are
            address = format_address(options.host, options.metrics_port)
            raise OSError(f"cannot listen on {address} for /metrics: {exc.strerror or exc}") from exc
    try:
        gateway = Gateway(options, credentials, metrics, sessions, arm_routers)
        await gateway.start(load)
    except BaseException:
        if metrics is not None:
            metrics.close()
        raise
    return gateway


async def serve(load: Loader, options: GatewayOptions, sessions: SessionStore | None = None,
                on_listening: Callable[[str], None] | None = None, on_metrics: Callable[[str], None] | None = None,
                arm_routers: ArmRouterFactory | None = None, on_http: Callable[[str], None] | None = None,
                on_ready: Callable[[float], None] | None = None) -> None:
    """Run until SIGTERM or SIGINT, then drain gracefully. on_http: told the HTTP API's base URL when it is on;
    on_ready: told the seconds from the start until readiness turned SERVING (loading, calibrating)."""
    started = time.monotonic()
    gateway = await start_gateway(load, options, sessions, arm_routers)
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
        serving = await gateway.ready()
    except Exception:
        await gateway.drain(0)
        raise
    if serving:
        freeze_loaded_heap()  # the engines and the gateway's own stack out of every later collection, once
    if serving and on_ready is not None:
        on_ready(time.monotonic() - started)
    await gateway.wait_closed()
