"""Per-arm canary metrics and decision counts: OpenTelemetry instruments when opentelemetry-api is installed (a
no-op until the process configures a MeterProvider), and always plain counters, readable through `snapshot()`.

Instruments (meter "tandem.canary"):
    tandem.canary.decisions      counter    deployment, arm, action, reason, source
    tandem.canary.requests       counter    deployment, arm, error
    tandem.canary.draft_tokens   counter    deployment, arm, accepted ("true"/"false")
    tandem.canary.tpot           histogram  deployment, arm (seconds)
    tandem.canary.greedy_checks  counter    deployment, arm, match
    tandem.canary.weight         gauge      deployment, arm (percent, from the shared state)
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

from tandem.canary.observations import GREEDY_CHECK, Outcome
from tandem.telemetry.metrics import TIME_PER_OUTPUT_TOKEN_BUCKETS

try:
    from opentelemetry import metrics as otel_metrics
except ImportError:  # optional: plain counters only
    otel_metrics = None


def default_meter():
    return otel_metrics.get_meter("tandem.canary") if otel_metrics is not None else None


class CanaryMetrics:
    def __init__(self, deployment: str, weights: Callable[[], dict[str, float]], meter=None) -> None:
        self.deployment = deployment
        self._weights = weights
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.drafted: Counter[str] = Counter()
        self.accepted: Counter[str] = Counter()
        self.greedy_checks: Counter[str] = Counter()
        self.greedy_mismatches: Counter[str] = Counter()
        self.decisions: Counter[tuple[str, str, str, str]] = Counter()  # (arm, action, reason, source)
        self.store_errors = 0
        meter = meter if meter is not None else default_meter()
        self._otel = meter is not None
        if self._otel:
            self._decisions = meter.create_counter("tandem.canary.decisions", description="canary decisions")
            self._requests = meter.create_counter("tandem.canary.requests", description="requests per canary arm")
            self._tokens = meter.create_counter("tandem.canary.draft_tokens", description="drafted tokens per arm")
            # Seconds, in the gateway's TPOT buckets: the SDK's default ones (0, 5, 10, 25, ...) put every token in
            # the first.
            self._tpot = meter.create_histogram("tandem.canary.tpot", unit="s", description="time per output token",
                                                explicit_bucket_boundaries_advisory=TIME_PER_OUTPUT_TOKEN_BUCKETS)
            self._checks = meter.create_counter("tandem.canary.greedy_checks",
                                                description="greedy-equality checks against plain decoding")
            meter.create_observable_gauge("tandem.canary.weight", callbacks=[self._observe_weights], unit="%",
                                          description="share of sessions per canary arm")

    def _attrs(self, arm: str, **extra) -> dict:
        return {"deployment": self.deployment, "arm": arm, **extra}

    def _observe_weights(self, options=None):
        from opentelemetry.metrics import Observation

        return [Observation(weight, self._attrs(arm)) for arm, weight in self._weights().items()]

    def outcome(self, arm: str, outcome: Outcome) -> None:
        with self._lock:
            if outcome.kind == GREEDY_CHECK:
                self.greedy_checks[arm] += 1
                self.greedy_mismatches[arm] += int(not outcome.greedy_match)
            else:
                self.requests[arm] += 1
                self.errors[arm] += int(outcome.error)
                self.drafted[arm] += outcome.drafted
                self.accepted[arm] += outcome.accepted
        if not self._otel:
            return
        if outcome.kind == GREEDY_CHECK:
            self._checks.add(1, self._attrs(arm, match=bool(outcome.greedy_match)))
            return
        self._requests.add(1, self._attrs(arm, error=outcome.error))
        if outcome.drafted:
            self._tokens.add(outcome.accepted, self._attrs(arm, accepted="true"))
            self._tokens.add(outcome.drafted - outcome.accepted, self._attrs(arm, accepted="false"))
        if outcome.tpot_s is not None:
            self._tpot.record(outcome.tpot_s, self._attrs(arm))

    def decision(self, arm: str, action: str, reason: str, source: str) -> None:
        with self._lock:
            self.decisions[arm, action, reason, source] += 1
        if self._otel:
            self._decisions.add(1, self._attrs(arm, action=action, reason=reason, source=source))

    def store_error(self) -> None:
        with self._lock:
            self.store_errors += 1

    def snapshot(self) -> dict:
        """The plain counters as a JSON-able dict."""
        with self._lock:
            arms = sorted(set(self.requests) | set(self.greedy_checks) | set(self._weights()))
            return {
                "deployment": self.deployment,
                "weights": self._weights(),
                "arms": {arm: {"requests": self.requests[arm], "errors": self.errors[arm],
                               "drafted": self.drafted[arm], "accepted": self.accepted[arm],
                               "greedy_checks": self.greedy_checks[arm],
                               "greedy_mismatches": self.greedy_mismatches[arm]} for arm in arms},
                "decisions": [{"arm": arm, "action": action, "reason": reason, "source": source, "count": count}
                              for (arm, action, reason, source), count in sorted(self.decisions.items())],
                "store_errors": self.store_errors,
            }
