"""The gateway's metrics (OpenTelemetry instruments, GenAI server conventions) and its Prometheus endpoint
(telemetry.endpoint).

Histograms use the conventions' bucket boundaries. Spec counters are added once per finished request, from its
RequestStats (per draft position); gauges are read at scrape time. Each instance owns its MeterProvider and
Prometheus registry, so several gateways (tests) can live in one process.

KV cache tokens (tandem.kv_tokens, by tandem.worker.role and tandem.kv.state: used, reserved, capacity) are read here
only for models in the gateway's process; Ray workers serve theirs on their own endpoints (tandem.worker.kv_tokens,
telemetry.worker), so a scrape never waits on a remote call.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from tandem.core.protocol import InProcessSide
from tandem.telemetry.endpoint import Endpoint, _gauge

if TYPE_CHECKING:
    from tandem.core.protocol import KVUsage
    from tandem.core.requests import Sequence

PROVIDER = "tandem"
DEFAULT_PORT = 9464
# https://opentelemetry.io/docs/specs/semconv/gen-ai/gen-ai-metrics/ (model server metrics)
REQUEST_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
TIME_PER_OUTPUT_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0)
KV_STATES = ("used", "reserved", "capacity")  # tandem.kv.state: the fields of core.protocol.KVUsage


def observe_shared_tokens(meter, callback: Callable[[], Iterator[tuple[float, dict]]], where: str) -> None:
    """The counter of prompt tokens copied from cached prefixes (KVUsage.shared), by the runners `where` says."""
    meter.create_observable_counter("tandem.kv.shared_tokens", _gauge(callback), unit="{token}",
                                    description=f"Prompt tokens whose keys and values {where} copied from a cached "
                                    "prefix (prefix caching) instead of computing them.")


def kv_observations(usage: KVUsage, attributes: dict) -> Iterator[tuple[float, dict]]:
    """One observation per tandem.kv.state."""
    for state in KV_STATES:
        yield getattr(usage, state), attributes | {"tandem.kv.state": state}


class GatewayMetrics:
    """Instruments for one gateway; `attach` gives the gauges a loaded engine to read."""

    def __init__(self, host: str = "127.0.0.1", ports: Iterable[int] = (DEFAULT_PORT,)) -> None:
        """Serve on the first of `ports` that binds (0: any free port)."""
        self.endpoint = Endpoint("tandem-gateway", host, ports)
        meter = self.endpoint.meter
        self.ttft = meter.create_histogram(
            "gen_ai.server.time_to_first_token", unit="s", description="Time to generate first token for successful "
            "responses.", explicit_bucket_boundaries_advisory=TIME_TO_FIRST_TOKEN_BUCKETS)
        self.tpot = meter.create_histogram(
            "gen_ai.server.time_per_output_token", unit="s", description="Time per output token generated after the "
            "first token for successful responses.", explicit_bucket_boundaries_advisory=TIME_PER_OUTPUT_TOKEN_BUCKETS)
        self.duration = meter.create_histogram(
            "gen_ai.server.request.duration", unit="s", description="Generative AI server request duration such as "
            "time-to-last byte or last output token.", explicit_bucket_boundaries_advisory=REQUEST_DURATION_BUCKETS)
        self.drafted = meter.create_counter("tandem.spec.drafted_tokens", unit="{token}",
                                            description="Draft tokens proposed, by draft position.")
        self.accepted = meter.create_counter("tandem.spec.accepted_tokens", unit="{token}",
                                             description="Draft tokens the target accepted, by draft position.")
        self.rounds = meter.create_counter("tandem.spec.rounds", unit="{round}",
                                           description="Rounds run, by kind (speculative, predicted, lookup, "
                                                       "plain, fallback).")
        self.predicted = meter.create_counter("tandem.spec.prediction_tokens", unit="{token}",
                                              description="Tokens of requests' predicted outputs drafted, by outcome "
                                                          "(accepted, rejected).")
        self.looked_up = meter.create_counter("tandem.spec.lookup_tokens", unit="{token}",
                                              description="Tokens drafted from requests' own context (prompt lookup), "
                                                          "by outcome (accepted, rejected).")
        meter.create_observable_gauge("tandem.spec.acceptance", _gauge(self._acceptance), unit="1",
                                      description="Accepted / drafted tokens since start, by draft model and position.")
        meter.create_observable_gauge("tandem.spec.sessions_in_fallback", _gauge(self._fallback), unit="{session}",
                                      description="Running requests whose session is in plain-decoding fallback.")
        meter.create_observable_gauge("tandem.gateway.queue_depth", _gauge(self._queued), unit="{request}",
                                      description="Requests admitted but waiting for a batch slot.")
        meter.create_observable_gauge("tandem.gateway.active_requests", _gauge(self._active), unit="{request}",
                                      description="Requests queued or running.")
        meter.create_observable_counter("tandem.engine.preemptions", _gauge(self._preemptions), unit="{sequence}",
                                        description="Sequences taken out of a step they ran in, by kind: priority "
                                        "(a lower priority value took the place; caches kept), kv (caches given up "
                                        "to a full KV budget; recomputed on resuming).")
        meter.create_observable_gauge("tandem.worker.healthy", _gauge(self._healthy), unit="1",
                                      description="1 while a draft worker / target replica is in service, else 0.")
        meter.create_observable_gauge("tandem.kv_tokens", _gauge(self._kv_tokens), unit="{token}",
                                      description="KV cache tokens of the models in this process, by role and state: "
                                      "used (held by running sequences and retained sessions), reserved (slots x "
                                      "capacity), capacity (the budget). Ray workers report on their own endpoints.")
        observe_shared_tokens(meter, self._shared_tokens, "the models in this process (by role)")
        self.background_ended = meter.create_counter(
            "tandem.responses.background_ended", unit="{response}",
            description="Background responses (Responses API) this gateway ran to an end, by status.")
        meter.create_observable_gauge("tandem.responses.background_running", _gauge(self._background_running),
                                      unit="{response}", description="Background responses running on this gateway.")
        self._background: Callable[[], int] | None = None
        self.batches_ended = meter.create_counter(
            "tandem.batches.ended", unit="{batch}",
            description="Batches (Batch API) this gateway ran to an end, by status.")
        # Every status from the start, at 0: a series that appears only at its first event reads as absent to an
        # alert's rate() and to a dashboard until then.
        for status in ("completed", "incomplete", "failed", "cancelled"):
            self.background_ended.add(0, {"status": status})
        for status in ("completed", "failed", "expired", "cancelled"):
            self.batches_ended.add(0, {"status": status})
        meter.create_observable_gauge("tandem.batches.running", _gauge(self._batches_running), unit="{batch}",
                                      description="Batches running on this gateway.")
        self._batches: Callable[[], int] | None = None
        meter.create_observable_gauge("tandem.sessions.store_available", _gauge(self._store_available), unit="1",
                                      description="1 while the shared session store (Redis) answers; 0 while this "
                                      "gateway keeps session state in memory, to write back once it answers again.")
        self._store_healthy: Callable[[], bool] | None = None
        self.base: dict[str, str] = {"gen_ai.provider.name": PROVIDER}
        self._spec_base: dict[str, str] = {}
        self._positions: dict[int, list[int]] = {}  # draft position -> [drafted, accepted]
        self._lock = threading.Lock()
        self._loop = None
        self._engine = None

    @property
    def url(self) -> str:
        return self.endpoint.url

    def attach(self, loop, target_model: str, draft_model: str) -> None:
        self._loop, self._engine = loop, loop.engine
        self.base = {"gen_ai.provider.name": PROVIDER, "gen_ai.request.model": target_model}
        self._spec_base = {"gen_ai.request.model": target_model, "tandem.draft.model": draft_model}

    def attach_background(self, running: Callable[[], int]) -> None:
        """The count of background responses running here, for its gauge."""
        self._background = running

    def background_end(self, status: str) -> None:
        self.background_ended.add(1, {"status": status})

    def attach_batches(self, running: Callable[[], int]) -> None:
        """The count of batches running here, for its gauge."""
        self._batches = running

    def batch_end(self, status: str) -> None:
        self.batches_ended.add(1, {"status": status})

    def attach_sessions(self, healthy: Callable[[], bool]) -> None:
        """Whether the session store answers now, for its gauge."""
        self._store_healthy = healthy

    def _store_available(self) -> Iterator[tuple[float, dict]]:
        if self._store_healthy is not None:
            yield int(self._store_healthy()), {}

    def _batches_running(self) -> Iterator[tuple[float, dict]]:
        if self._batches is not None:
            yield self._batches(), {}

    def _background_running(self) -> Iterator[tuple[float, dict]]:
        if self._background is not None:
            yield self._background(), {}

    def record_request(self, seq: Sequence) -> None:
        """A request finished (engine thread): add its rounds and per-position draft counts."""
        stats = seq.stats
        if stats.rounds:
            plain = stats.rounds - stats.spec_rounds - stats.predicted_rounds - stats.lookup_rounds
            for kind, count in (("speculative", stats.spec_rounds), ("predicted", stats.predicted_rounds),
                                ("lookup", stats.lookup_rounds),
                                ("plain", plain - stats.fallback_rounds), ("fallback", stats.fallback_rounds)):
                if count:
                    self.rounds.add(count, self._spec_base | {"tandem.spec.round_kind": kind})
        if stats.predicted_rounds:
            for outcome, count in (("accepted", stats.prediction_accepted), ("rejected", stats.prediction_rejected)):
                self.predicted.add(count, self._spec_base | {"tandem.spec.outcome": outcome})
        if stats.lookup_rounds:
            for outcome, count in (("accepted", stats.lookup_accepted), ("rejected", stats.lookup_rejected)):
                self.looked_up.add(count, self._spec_base | {"tandem.spec.outcome": outcome})
        if not stats.drafted:
            return
        with self._lock:
            for position, (drafted, accepted) in enumerate(zip(stats.drafted_at, stats.accepted_at, strict=True)):
                attributes = self._spec_base | {"tandem.spec.position": position}
                self.drafted.add(drafted, attributes)
                self.accepted.add(accepted, attributes)
                totals = self._positions.setdefault(position, [0, 0])
                totals[0] += drafted
                totals[1] += accepted

    def _acceptance(self) -> Iterator[tuple[float, dict]]:
        with self._lock:
            positions = {p: tuple(v) for p, v in self._positions.items()}
        drafted = sum(d for d, _ in positions.values())
        if drafted:
            yield sum(a for _, a in positions.values()) / drafted, self._spec_base | {"tandem.spec.position": "all"}
        for position, (d, a) in sorted(positions.items()):
            yield a / d, self._spec_base | {"tandem.spec.position": position}

    def _fallback(self) -> Iterator[tuple[float, dict]]:
        if self._loop is not None:
            yield self._loop.sessions_in_fallback(), self._spec_base

    def _queued(self) -> Iterator[tuple[float, dict]]:
        if self._loop is not None:
            yield max(0, self._loop.active - self._loop.batch_capacity), {}

    def _preemptions(self) -> Iterator[tuple[float, dict]]:
        if self._loop is not None:
            for kind, count in self._loop.preemptions().items():
                yield count, {"kind": kind}

    def _active(self) -> Iterator[tuple[float, dict]]:
        if self._loop is not None:
            yield self._loop.active, {}

    def _healthy(self) -> Iterator[tuple[float, dict]]:
        engine = self._engine
        if engine is None:
            return
        for role, side in (("draft", engine.drafter), ("target", engine.verifier)):
            if side is None:
                continue
            for index, worker in enumerate(side.worker_health()):
                yield int(worker.healthy), {"tandem.worker.role": role, "tandem.worker.index": index}

    def _local_kv_usage(self) -> Iterator[tuple[str, KVUsage]]:
        """(role, KV usage) of each model in this process: a cheap local read; never a remote call."""
        engine = self._engine
        if engine is None:
            return
        for role, pool in (("draft", engine.drafter), ("target", engine.verifier)):
            if isinstance(pool, InProcessSide):
                yield role, pool.kv_usage()

    def _kv_tokens(self) -> Iterator[tuple[float, dict]]:
        for role, usage in self._local_kv_usage():
            yield from kv_observations(usage, {"tandem.worker.role": role})

    def _shared_tokens(self) -> Iterator[tuple[float, dict]]:
        for role, usage in self._local_kv_usage():
            yield usage.shared, {"tandem.worker.role": role}

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.endpoint.close()
