"""A Prometheus endpoint for a MeterProvider's instruments, as the gateway and each Ray worker serve one.

Each Endpoint owns its MeterProvider and Prometheus registry, so several can live in one process (tests); each also
serves its process's own families (telemetry.process). Observable instruments read their values at scrape time
through `_gauge`, which lets a scrape that races a shutdown pass.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from wsgiref.simple_server import WSGIServer

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from prometheus_client import CollectorRegistry, start_http_server

from tandem.telemetry.process import observe_process
from tandem.telemetry.tracing import resource_for

log = logging.getLogger(__name__)


def serve_registry(registry: CollectorRegistry, host: str, ports: Iterable[int]) -> tuple[WSGIServer, int]:
    """Serve /metrics on the first of `ports` that binds (0: any free port); raises the last OSError."""
    error: OSError | None = None
    taken: list[int] = []
    for port in ports:
        try:
            server, _ = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            error = exc
            taken.append(port)
            continue
        if taken:  # a scraper configured for the taken port would read another process's metrics
            log.warning("metrics port %d is taken: /metrics serves on %d instead (--metrics-port chooses one)",
                        taken[0], server.server_port)
        return server, server.server_port
    raise error or OSError("no port to listen on")


def metrics_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}/metrics" if ":" in host else f"http://{host}:{port}/metrics"


class Endpoint:
    """A MeterProvider whose instruments a Prometheus endpoint serves."""

    def __init__(self, service_name: str, host: str, ports: Iterable[int]) -> None:
        self.registry = CollectorRegistry()
        reader = PrometheusMetricReader(scope_info_enabled=False, registry=self.registry)
        self.provider = MeterProvider(metric_readers=[reader], resource=resource_for(service_name))
        self.meter = self.provider.get_meter("tandem")
        observe_process(self.registry, self.meter)
        self.host = host
        self.server, self.port = serve_registry(self.registry, host, ports)

    @property
    def url(self) -> str:
        return metrics_url(self.host, self.port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.provider.shutdown()


def _gauge(callback: Callable[[], Iterator[tuple[float, dict]]]):
    def observe(options: CallbackOptions) -> Iterator[Observation]:
        try:
            for value, attributes in callback():
                yield Observation(value, attributes)
        except Exception:  # a scrape racing a shutdown; the next scrape sees settled state
            log.debug("gauge callback failed", exc_info=True)

    return [observe]
