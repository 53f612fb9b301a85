"""The shared canary state of one deployment: arms with their live weights, the step schedule, thresholds, status
and the decision log. Stored as one JSON document (see store.py); every change is a new immutable state.

`generation` counts weight changes: observations are kept per generation, so each promotion step (and each manual
change) is judged on traffic it actually served. `version` counts every write.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from tandem.canary.analysis import PROMOTE, ROLLBACK, Thresholds
from tandem.canary.arms import WEIGHT_TOLERANCE, ArmSpec, validate_arms
from tandem.errors import InvalidArgument

RUNNING, PROMOTED, ROLLED_BACK, IDLE = "running", "promoted", "rolled_back", "idle"
STATUSES = (RUNNING, PROMOTED, ROLLED_BACK, IDLE)
SET, CONFIGURE = "set", "configure"
DEFAULT_STEPS = (5.0, 25.0, 50.0, 100.0)
LOG_LIMIT = 200
RETIRED_LIMIT = 32


@dataclass(slots=True, frozen=True)
class DecisionRecord:
    at: float
    arm: str
    action: str  # promote, rollback, set, configure
    code: str  # short reason: healthy, acceptance_drop, tpot_p50, ..., manual, config
    reasons: tuple[str, ...]
    source: str  # auto (a gateway's analysis), cli, config (a gateway registering its arms)
    weights_before: dict
    weights_after: dict
    generation: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"reasons": list(self.reasons)}

    @classmethod
    def from_dict(cls, data: Mapping) -> DecisionRecord:
        return cls(**(dict(data) | {"reasons": tuple(data.get("reasons", ()))}))


def validate_steps(steps: Iterable[float]) -> tuple[float, ...]:
    steps = tuple(float(step) for step in steps)
    if not steps or any(not math.isfinite(s) or not 0 < s <= 100 for s in steps) \
            or any(b <= a for a, b in itertools.pairwise(steps)) or steps[-1] != 100.0:
        raise InvalidArgument(f"steps: must rise strictly within (0, 100] and end at 100, got {list(steps)}")
    return steps


@dataclass(slots=True, frozen=True)
class CanaryState:
    deployment: str
    arms: tuple[ArmSpec, ...]
    baseline: str
    steps: tuple[float, ...] = DEFAULT_STEPS
    thresholds: Thresholds = field(default_factory=Thresholds)
    status: str = RUNNING
    auto: bool = True
    generation: int = 1
    version: int = 1
    config_fingerprint: str = ""  # set when a gateway registered the arms from its configuration
    retired: tuple[str, ...] = ()  # fingerprints of configurations this experiment replaced (never re-registered)
    log: tuple[DecisionRecord, ...] = ()

    def __post_init__(self) -> None:
        if not self.deployment or not isinstance(self.deployment, str):
            raise InvalidArgument("deployment: must be a non-empty name")
        object.__setattr__(self, "arms", validate_arms(self.arms))
        if self.baseline not in self.weights:
            raise InvalidArgument(f"baseline: {self.baseline!r} is not an arm (arms: {', '.join(self.weights)})")
        object.__setattr__(self, "steps", validate_steps(self.steps))
        if self.status not in STATUSES:
            raise InvalidArgument(f"status: must be one of {STATUSES}, got {self.status!r}")

    @property
    def weights(self) -> dict[str, float]:
        return {arm.name: arm.weight for arm in self.arms}

    @property
    def candidates(self) -> list[ArmSpec]:
        return [arm for arm in self.arms if arm.name != self.baseline]

    def arm(self, name: str) -> ArmSpec:
        for arm in self.arms:
            if arm.name == name:
                return arm
        raise InvalidArgument(f"arm: no arm {name!r} (arms: {', '.join(self.weights)})")

    def candidate(self, name: str | None) -> ArmSpec:
        """The named candidate, or the only candidate with traffic (else the only candidate) when unnamed."""
        if name is not None:
            if name == self.baseline:
                raise InvalidArgument(f"arm: {name!r} is the baseline; name a candidate arm")
            return self.arm(name)
        for pool in ([arm for arm in self.candidates if arm.weight > 0], self.candidates):
            if len(pool) == 1:
                return pool[0]
        raise InvalidArgument(f"arm: name one of {', '.join(a.name for a in self.candidates) or '(no candidates)'}")

    def next_step(self, arm: ArmSpec) -> float:
        return next((step for step in self.steps if step > arm.weight + WEIGHT_TOLERANCE), 100.0)

    def _status_for(self, weights: Mapping[str, float], action: str) -> str:
        shares = [weights[arm.name] for arm in self.candidates]
        if any(share >= 100.0 - WEIGHT_TOLERANCE for share in shares):
            return PROMOTED
        if any(share > 0 for share in shares):
            return RUNNING
        return ROLLED_BACK if action == ROLLBACK else IDLE

    def _record(self, arm: str, action: str, code: str, reasons: Iterable[str], source: str,
                after: Mapping[str, float], generation: int) -> DecisionRecord:
        return DecisionRecord(round(time.time(), 3), arm, action, code, tuple(reasons), source, self.weights,
                              dict(after), generation)

    def with_weights(self, weights: Mapping[str, float], *, arm: str = "", action: str = SET, code: str = "manual",
                     reasons: Iterable[str] = (), source: str = "cli") -> tuple[CanaryState, DecisionRecord]:
        """New weights (arms left out get 0; they must sum to 100), a new generation, and the decision logged."""
        if unknown := sorted(set(weights) - set(self.weights)):
            raise InvalidArgument(f"weights: unknown arm(s) {unknown} (arms: {', '.join(self.weights)})")
        after = {name: float(weights.get(name, 0.0)) for name in self.weights}
        arms = validate_arms(arm_spec.with_weight(after[arm_spec.name]) for arm_spec in self.arms)
        record = self._record(arm or ",".join(sorted(weights)), action, code, reasons, source, after,
                              self.generation + 1)
        state = dataclasses.replace(self, arms=arms, status=self._status_for(after, action),
                                    generation=self.generation + 1, version=self.version + 1,
                                    log=(*self.log, record)[-LOG_LIMIT:])
        return state, record

    def promote(self, name: str | None = None, *, to: float | None = None, code: str = "manual",
                reasons: Iterable[str] = (), source: str = "cli") -> tuple[CanaryState, DecisionRecord]:
        """The candidate up one step of the schedule (or to `to` percent); at 100 every other arm drops to 0."""
        arm = self.candidate(name)
        share = self.next_step(arm) if to is None else float(to)
        if not arm.weight < share <= 100.0:
            raise InvalidArgument(f"to: must be above {arm.name}'s weight {arm.weight:g} and at most 100, "
                                  f"got {share:g}")
        if share >= 100.0:
            weights = {arm.name: 100.0}
        else:
            weights = self.weights | {arm.name: share}
            weights[self.baseline] = 100.0 - sum(w for n, w in weights.items() if n != self.baseline)
            if weights[self.baseline] < -WEIGHT_TOLERANCE:
                raise InvalidArgument(f"to: {share:g}% leaves the baseline a negative weight")
            weights[self.baseline] = max(0.0, weights[self.baseline])
        return self.with_weights(weights, arm=arm.name, action=PROMOTE, code=code, reasons=reasons, source=source)

    def rollback(self, name: str | None = None, *, code: str = "manual", reasons: Iterable[str] = (),
                 source: str = "cli") -> tuple[CanaryState, DecisionRecord]:
        """The candidate's weight to 0, given to the baseline."""
        arm = self.candidate(name)
        weights = self.weights | {arm.name: 0.0}
        weights[self.baseline] += arm.weight
        return self.with_weights(weights, arm=arm.name, action=ROLLBACK, code=code, reasons=reasons, source=source)

    def configured(self, *, thresholds: Thresholds | None = None, auto: bool | None = None,
                   steps: Iterable[float] | None = None, source: str = "cli") -> tuple[CanaryState, DecisionRecord]:
        """Thresholds, automatic decisions on/off or the step schedule changed (weights and generation kept)."""
        changes: dict = {}
        if thresholds is not None:
            changes["thresholds"] = thresholds
        if auto is not None:
            changes["auto"] = auto
        if steps is not None:
            changes["steps"] = validate_steps(steps)
        reasons = [f"{key}: {value.to_dict() if isinstance(value, Thresholds) else value}"
                   for key, value in changes.items()]
        record = self._record("", CONFIGURE, "manual", reasons, source, self.weights, self.generation)
        state = dataclasses.replace(self, **changes, version=self.version + 1, log=(*self.log, record)[-LOG_LIMIT:])
        return state, record

    def to_dict(self) -> dict:
        return {"deployment": self.deployment, "arms": [arm.to_dict() for arm in self.arms],
                "baseline": self.baseline, "steps": list(self.steps), "thresholds": self.thresholds.to_dict(),
                "status": self.status, "auto": self.auto, "generation": self.generation, "version": self.version,
                "config_fingerprint": self.config_fingerprint, "retired": list(self.retired),
                "log": [record.to_dict() for record in self.log]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Mapping) -> CanaryState:
        return cls(deployment=data["deployment"], arms=tuple(ArmSpec.from_dict(a) for a in data["arms"]),
                   baseline=data["baseline"], steps=tuple(data.get("steps", DEFAULT_STEPS)),
                   thresholds=Thresholds.from_dict(data.get("thresholds", {})), status=data.get("status", RUNNING),
                   auto=bool(data.get("auto", True)), generation=int(data.get("generation", 1)),
                   version=int(data.get("version", 1)), config_fingerprint=data.get("config_fingerprint", ""),
                   retired=tuple(data.get("retired", ())),
                   log=tuple(DecisionRecord.from_dict(r) for r in data.get("log", ())))

    @classmethod
    def from_json(cls, text: str) -> CanaryState:
        return cls.from_dict(json.loads(text))


def new_state(deployment: str, arms: Iterable[ArmSpec], *, baseline: str | None = None,
              steps: Iterable[float] = DEFAULT_STEPS, thresholds: Thresholds | None = None, auto: bool = True,
              source: str = "cli", config_fingerprint: str = "", previous: CanaryState | None = None) -> CanaryState:
    """A fresh experiment: the baseline is `baseline`, else an arm named "stable", else the first arm. Replacing
    `previous`, it continues its generation count (so old observation windows are not reused) and its log."""
    arms = validate_arms(arms)
    names = [arm.name for arm in arms]
    base = baseline or ("stable" if "stable" in names else names[0])
    generation = previous.generation + 1 if previous is not None else 1
    state = CanaryState(deployment, arms, base, tuple(steps), thresholds or Thresholds(), IDLE, auto, generation,
                        previous.version + 1 if previous is not None else 1, config_fingerprint)
    status = state._status_for(state.weights, "register")
    record = DecisionRecord(round(time.time(), 3), ",".join(names), "register", "config" if source == "config"
                            else "manual", (f"arms: {', '.join(f'{a.name}={a.weight:g}' for a in arms)}",), source,
                            previous.weights if previous is not None else {}, state.weights, generation)
    log = (*previous.log, record)[-LOG_LIMIT:] if previous is not None else (record,)
    retired = () if previous is None else tuple(dict.fromkeys(
        (*previous.retired, previous.config_fingerprint) if previous.config_fingerprint else previous.retired))
    return dataclasses.replace(state, status=status, log=log, retired=retired[-RETIRED_LIMIT:])
