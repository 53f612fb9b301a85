"""The canary's analysis and decisions: the deciding half of CanaryController (canary.controller).

A decision analyses the arms' shared observation windows of the current generation, records the evaluation in the
store, and applies at most one promote or rollback (a rollback first), only while the state is still at the generation
it analysed: however many replicas decide at once, one step is taken once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from tandem.canary import analysis
from tandem.canary.analysis import Verdict, judge
from tandem.canary.arms import ArmSpec
from tandem.canary.greedy_check import GreedyChecker
from tandem.canary.metrics import CanaryMetrics
from tandem.canary.observations import ArmSummary, Outcome, summarize
from tandem.canary.state import RUNNING, CanaryState, DecisionRecord
from tandem.canary.store import CanaryStore, CanaryStoreError

log = logging.getLogger(__name__)


class CanaryDecisions:
    """CanaryController's deciding methods; CanaryController sets the state below and defines `flush`, `refresh` and
    `_store_failed`."""

    store: CanaryStore
    deployment: str
    window: int
    greedy: GreedyChecker | None
    replica: str
    on_decision: Callable[[DecisionRecord], None] | None
    _state: CanaryState | None
    _loaded_at: float
    _healthy: bool
    _since_decide: int
    _lock: threading.Lock
    _decide_lock: threading.Lock
    _metrics: CanaryMetrics

    def windows(self, state: CanaryState) -> dict[str, list[Outcome]]:
        """Each arm's observations of the state's generation (the newest `window`)."""
        return {arm.name: self.store.outcomes(self.deployment, state.generation, arm.name, self.window)
                for arm in state.arms}

    @staticmethod
    def summaries(state: CanaryState, windows: dict[str, list[Outcome]]) -> dict[str, ArmSummary]:
        """Each arm's window as the analysis sees it: every tenant capped at the thresholds' max_tenant_share."""
        return {name: summarize(outcomes, state.thresholds.max_tenant_share) for name, outcomes in windows.items()}

    def _draft_canary(self, arm: ArmSpec, baseline: ArmSpec) -> bool:
        return self.greedy is not None and self.greedy.rate > 0 and arm.same_model_as(baseline) \
            and arm.enabled is not False and arm.k_max != 0

    def maybe_decide(self) -> list[DecisionRecord]:
        """Flush, analyse the current generation's windows, and apply at most one promote or rollback."""
        if not self._decide_lock.acquire(blocking=False):
            return []  # another thread is deciding
        try:
            with self._lock:
                self._since_decide = 0
            self.flush()
            state = self.refresh()
            if state is None or not self._healthy:
                return []
            windows = self.windows(state)
            summaries = self.summaries(state, windows)
            verdicts: dict[str, Verdict] = {}
            if state.status == RUNNING and state.auto:
                base_arm = state.arm(state.baseline)
                for arm in state.candidates:
                    if arm.weight > 0:
                        verdicts[arm.name] = judge(windows[state.baseline], windows[arm.name], state.thresholds,
                                                   self._draft_canary(arm, base_arm))[0]
            self.store.put_evaluation(self.deployment, {
                "at": round(time.time(), 3), "by": self.replica, "generation": state.generation,
                "arms": {name: summary.to_dict() for name, summary in summaries.items()},
                "verdicts": {name: {"action": v.action, "code": v.code, "reasons": list(v.reasons)}
                             for name, v in verdicts.items()}})
            order = sorted(verdicts.items(), key=lambda item: item[1].action != analysis.ROLLBACK)
            for name, verdict in order:
                if verdict.action != analysis.HOLD and (record := self._apply(state.generation, name, verdict)):
                    return [record]
            return []
        except CanaryStoreError as exc:
            self._store_failed(exc)
            return []
        finally:
            self._decide_lock.release()

    def _apply(self, generation: int, arm: str, verdict: Verdict) -> DecisionRecord | None:
        made: list[DecisionRecord] = []

        def change(current: CanaryState | None) -> CanaryState | None:
            made.clear()
            if current is None or current.generation != generation or current.status != RUNNING \
                    or not current.auto or current.arm(arm).weight <= 0:
                return None  # someone else decided first, or an operator took over
            step = current.promote if verdict.action == analysis.PROMOTE else current.rollback
            new, record = step(arm, code=verdict.code, reasons=verdict.reasons, source="auto")
            made.append(record)
            return new

        state = self.store.update(self.deployment, change)
        if not made:
            return None
        self._state, self._loaded_at = state, time.monotonic()
        self._announce(made[0])
        return made[0]

    def _announce(self, record: DecisionRecord) -> None:
        level = logging.WARNING if record.action == analysis.ROLLBACK else logging.INFO
        log.log(level, "canary %s: %s %s (%s): weights %s -> %s; %s", self.deployment, record.action, record.arm,
                record.code, record.weights_before, record.weights_after, "; ".join(record.reasons))
        self._metrics.decision(record.arm, record.action, record.code, record.source)
        if self.on_decision is not None:
            try:
                self.on_decision(record)
            except Exception:
                log.exception("canary on_decision hook failed")
