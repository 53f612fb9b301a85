"""CanaryController: one per gateway replica. Assigns sessions to arms, records outcomes, and periodically runs the
analysis on the arms' shared observation windows, applying promote/rollback decisions to the shared state
(canary.decisions).

Every replica may decide; a decision applies only if the state is still at the generation it analysed (a WATCH
transaction), so one step is taken once however many replicas run the analysis. Redis outages are logged once and
counted; meanwhile the controller routes on its last known state and buffers observations (bounded).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Collection, Iterable

from tandem.canary.analysis import Thresholds
from tandem.canary.arms import ArmSpec, fingerprint
from tandem.canary.assignment import Assignment, choose_arm, ordered, session_key, session_point
from tandem.canary.decisions import CanaryDecisions
from tandem.canary.greedy_check import GreedyChecker
from tandem.canary.metrics import CanaryMetrics
from tandem.canary.observations import Outcome
from tandem.canary.secret import CanarySecret, random_secret
from tandem.canary.state import DEFAULT_STEPS, CanaryState, DecisionRecord, new_state
from tandem.canary.store import CanaryStore, CanaryStoreError

log = logging.getLogger(__name__)


class CanaryController(CanaryDecisions):
    def __init__(self, store: CanaryStore, deployment: str = "default", *, arms: Iterable[ArmSpec] = (),
                 served: Collection[str] | None = None, baseline: str | None = None,
                 thresholds: Thresholds | None = None, steps: Iterable[float] = DEFAULT_STEPS,
                 cache_ttl_s: float = 1.0, window: int = 2000, decide_every: int = 0,
                 greedy: GreedyChecker | None = None, meter=None, retry_s: float = 5.0, max_buffered: int = 20_000,
                 on_decision: Callable[[DecisionRecord], None] | None = None,
                 secret: CanarySecret | None = None) -> None:
        """secret: keys session placement; every replica of the deployment needs the same one (None: this process's
        random one, see canary/secret.py)."""
        self.store, self.deployment = store, deployment
        self._secret = secret if secret is not None else random_secret()
        self.arms = tuple(arms)
        self.served = frozenset(served if served is not None else (arm.name for arm in self.arms))
        self.baseline, self.thresholds, self.steps = baseline, thresholds, tuple(steps)
        self.cache_ttl_s, self.window, self.decide_every = cache_ttl_s, window, decide_every
        self.greedy, self.retry_s, self.max_buffered, self.on_decision = greedy, retry_s, max_buffered, on_decision
        self.replica = f"{socket.gethostname()}-{os.getpid()}"
        self.dropped = 0  # observations dropped while the store was unreachable
        self._fingerprint = fingerprint(self.arms) if self.arms else ""
        self._state: CanaryState | None = None
        self._loaded_at = -math.inf
        self._healthy, self._retry_at = True, 0.0
        self._pending: dict[tuple[int, str], list[Outcome]] = {}
        self._buffered = self._since_decide = 0
        self._lock, self._decide_lock = threading.Lock(), threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._metrics = CanaryMetrics(deployment, lambda: self._state.weights if self._state else {}, meter)

    # ---- the shared state, cached -----------------------------------------------------------------------------
    def state(self, refresh: bool = False) -> CanaryState | None:
        """The cached state; reloaded here when older than cache_ttl_s, unless the ticker (start()) keeps it fresh,
        so that with the ticker running, arm_for never waits on the store."""
        if refresh or (self._thread is None and time.monotonic() - self._loaded_at > self.cache_ttl_s):
            self.refresh()
        return self._state

    def refresh(self) -> CanaryState | None:
        now = time.monotonic()
        if not self._healthy and now < self._retry_at:
            return self._state
        try:
            state = self.store.load(self.deployment)
            if self.arms and (state is None or self._replaces(state)):
                state = self.store.update(self.deployment, self._register)
        except CanaryStoreError as exc:
            self._store_failed(exc)
            if self._state is None and self.arms:  # route on the configured arms until the store answers
                self._state = self._new_state(None)
            return self._state
        self._store_ok()
        previous, self._state, self._loaded_at = self._state, state, time.monotonic()
        if previous is not None and state is not None and state.generation != previous.generation:
            log.info("canary %s: generation %d, weights %s, status %s", self.deployment, state.generation,
                     state.weights, state.status)
        return state

    def _replaces(self, state: CanaryState) -> bool:
        """A gateway's configured arms replace a stored experiment that another gateway configuration registered,
        unless that experiment already replaced this configuration (an old replica during a rollout)."""
        return bool(state.config_fingerprint) and state.config_fingerprint != self._fingerprint \
            and self._fingerprint not in state.retired

    def _new_state(self, previous: CanaryState | None) -> CanaryState:
        return new_state(self.deployment, self.arms, baseline=self.baseline, steps=self.steps,
                         thresholds=self.thresholds, source="config", config_fingerprint=self._fingerprint,
                         previous=previous)

    def _register(self, current: CanaryState | None) -> CanaryState | None:
        if current is not None and not self._replaces(current):
            return None  # registered meanwhile by another replica
        state = self._new_state(current)
        log.info("canary %s: registered arms %s (baseline %s)", self.deployment, state.weights, state.baseline)
        return state

    def _store_failed(self, exc: Exception) -> None:
        self._metrics.store_error()
        if self._healthy:
            log.warning("canary %s: state store unreachable (%s); routing on the last known weights", self.deployment,
                        exc)
        self._healthy, self._retry_at = False, time.monotonic() + self.retry_s

    def _store_ok(self) -> None:
        if not self._healthy:
            log.warning("canary %s: state store reachable again", self.deployment)
        self._healthy = True

    # ---- requests ---------------------------------------------------------------------------------------------
    def arm_for(self, session_id: str = "", request_id: str = "", tenant: str = "") -> Assignment | None:
        """The arm for a request: sticky per tenant and session (a keyed hash of both against the cumulative
        weights, which clients cannot compute: assignment.py)."""
        state = self.state()
        if state is None:
            return None
        key = session_key(session_id, request_id, tenant)
        arms = ordered(state.arms, state.baseline)
        arm, baseline = choose_arm(arms, session_point(key, self._secret.key, self.deployment)), arms[0]
        if self.served and arm.name not in self.served:
            substitute = baseline if baseline.name in self.served else next(
                (a for a in self.arms if a.name in self.served), baseline)
            return Assignment(substitute, baseline, key, state.generation, fallback=True, tenant=tenant)
        return Assignment(arm, baseline, key, state.generation, tenant=tenant)

    def record(self, assignment: Assignment, outcome: Outcome) -> None:
        """Note a finished request (or greedy check) of the assignment's arm; cheap, no I/O unless decide_every."""
        if assignment.fallback:
            return
        if outcome.tenant != assignment.tenant:  # the analysis caps each tenant's weight: every outcome names its own
            outcome = dataclasses.replace(outcome, tenant=assignment.tenant)
        self._metrics.outcome(assignment.arm.name, outcome)
        with self._lock:
            self._pending.setdefault((assignment.generation, assignment.arm.name), []).append(outcome)
            self._buffered += 1
            self._since_decide += 1
            if self._buffered > self.max_buffered:
                oldest = next(iter(self._pending))
                self._pending[oldest].pop(0)
                self._buffered -= 1
                self.dropped += 1
                if not self._pending[oldest]:
                    del self._pending[oldest]
            due = self.decide_every and self._since_decide >= self.decide_every
        if due:
            self.maybe_decide()

    def check_greedy(self, assignment: Assignment, greedy: bool, prompt_ids: list[int], output_ids: list[int]) -> bool:
        """Maybe (sampled) compare the output with plain decoding; the result is recorded when it is ready."""
        if self.greedy is None or assignment.fallback or not self.greedy.wants(
                assignment.key, greedy, assignment.arm, assignment.baseline, self._secret.key):
            return False

        def done(match: bool) -> None:
            self.record(assignment, Outcome.greedy_check(assignment.session, match))

        return self.greedy.submit(prompt_ids, output_ids, done)

    def flush(self) -> None:
        with self._lock:
            pending, self._pending, buffered, self._buffered = self._pending, {}, self._buffered, 0
        if not pending:
            return
        try:
            self.store.append(self.deployment, pending, self.window)
        except CanaryStoreError as exc:
            self._store_failed(exc)
            with self._lock:  # keep them for the next flush, newest first within the bound
                for key, items in pending.items():
                    self._pending[key] = items + self._pending.get(key, [])
                self._buffered += buffered

    # ---- lifecycle --------------------------------------------------------------------------------------------
    def start(self, decide_interval_s: float = 10.0) -> None:
        """A daemon thread: refresh the state every cache_ttl_s, flush and decide every decide_interval_s."""
        if self._thread is not None:
            return
        self.refresh()

        def run() -> None:
            next_decision = time.monotonic() + decide_interval_s
            while not self._stop.wait(self.cache_ttl_s):
                try:
                    if time.monotonic() >= next_decision:
                        next_decision = time.monotonic() + decide_interval_s
                        self.maybe_decide()
                    else:
                        self.refresh()
                except Exception:
                    log.exception("canary %s: tick failed", self.deployment)

        self._thread = threading.Thread(target=run, name="tandem-canary", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        if self.greedy is not None:
            self.greedy.close()
        self.flush()

    def metrics(self) -> dict:
        snapshot = self._metrics.snapshot()
        state = self._state
        return snapshot | {"status": state.status if state else None, "generation": state.generation if state else None,
                           "store_healthy": self._healthy, "buffered": self._buffered, "dropped": self.dropped}
