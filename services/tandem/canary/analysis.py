"""The automatic analysis: compare a candidate arm with the baseline and say hold, promote one step, or roll back.

Pure functions of two ArmSummary windows and the thresholds, so they are tested with known inputs. Rules, in order:

1. Greedy mismatch. With a clean baseline (no mismatches of its own) and zero tolerance, one mismatch rolls back at
   once: the speculative core is exact, so a draft canary whose greedy output differs from plain decoding is broken.
   Where the baseline mismatches too (bf16 near-ties, see README), the mismatch rates are compared once both arms
   have `min_greedy_checks` checks.
2. Fewer than `min_sessions` sessions on either arm: hold.
3. Any regression beyond its threshold rolls back, naming every one: acceptance drop (absolute), TPOT p50 and p99
   ratios, error-rate increase (absolute).
4. A draft canary still short of `min_greedy_checks` checks: hold. Otherwise: promote one step.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from tandem.canary.observations import ArmSummary
from tandem.errors import InvalidArgument

HOLD = "hold"
PROMOTE = "promote"
ROLLBACK = "rollback"


@dataclass(slots=True, frozen=True)
class Thresholds:
    min_sessions: int = 50
    max_acceptance_drop: float = 0.10
    max_tpot_p50_ratio: float = 1.10
    max_tpot_p99_ratio: float = 1.25
    max_error_rate_increase: float = 0.01
    greedy_mismatch_tolerance: float = 0.0
    min_greedy_checks: int = 0

    def __post_init__(self) -> None:
        for name in ("min_sessions", "min_greedy_checks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgument(f"{name}: must be a non-negative integer, got {value!r}")
        for name in ("max_acceptance_drop", "max_error_rate_increase", "greedy_mismatch_tolerance"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
                raise InvalidArgument(f"{name}: must be in [0, 1], got {value!r}")
        for name in ("max_tpot_p50_ratio", "max_tpot_p99_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value)
                                                                                    and value >= 1.0):
                raise InvalidArgument(f"{name}: must be a finite ratio >= 1, got {value!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Thresholds:
        known = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(data) - known):
            raise InvalidArgument(f"thresholds: unknown {unknown} (known: {sorted(known)})")
        return cls(**data)

    def with_text(self, assignments: list[str]) -> Thresholds:
        """These thresholds with `name=value` assignments applied (the CLI's --threshold)."""
        changes: dict = {}
        types = {f.name: f.type for f in dataclasses.fields(self)}
        for item in assignments:
            name, sep, text = item.partition("=")
            if not sep or name not in types:
                raise InvalidArgument(f"thresholds: expected NAME=VALUE with NAME one of {sorted(types)}, got {item!r}")
            try:
                changes[name] = int(text) if types[name] in ("int", int) else float(text)
            except ValueError:
                raise InvalidArgument(f"{name}: not a number: {text!r}") from None
        return dataclasses.replace(self, **changes)


@dataclass(slots=True, frozen=True)
class Verdict:
    action: str  # HOLD, PROMOTE or ROLLBACK
    code: str  # a short, low-cardinality reason (a metric attribute): the first reason's kind
    reasons: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.action not in (HOLD, PROMOTE, ROLLBACK):
            raise InvalidArgument(f"action: must be hold, promote or rollback, got {self.action!r}")


def _fmt(value: float | None, scale: float = 1.0, unit: str = "") -> str:
    return "n/a" if value is None else f"{value * scale:.3g}{unit}"


def _greedy_regression(base: ArmSummary, cand: ArmSummary, th: Thresholds) -> str | None:
    if not cand.greedy_mismatches:
        return None
    text = f"greedy output differs from plain decoding in {cand.greedy_mismatches}/{cand.greedy_checks} checks"
    if base.greedy_mismatches == 0 and th.greedy_mismatch_tolerance == 0.0:
        return text  # exact numerics: one mismatch is conclusive
    if cand.greedy_checks < th.min_greedy_checks or (base.greedy_mismatches
                                                     and base.greedy_checks < th.min_greedy_checks):
        return None
    if cand.greedy_mismatch_rate - base.greedy_mismatch_rate > th.greedy_mismatch_tolerance:
        return f"{text} (rate {cand.greedy_mismatch_rate:.3f} vs baseline {base.greedy_mismatch_rate:.3f})"
    return None


def regressions(base: ArmSummary, cand: ArmSummary, th: Thresholds) -> list[tuple[str, str]]:
    """(code, reason) for every metric where the candidate is worse than the baseline beyond its threshold."""
    found = []
    if base.acceptance is not None and cand.acceptance is not None \
            and base.acceptance - cand.acceptance > th.max_acceptance_drop:
        found.append(("acceptance_drop", f"acceptance {cand.acceptance:.3f} vs baseline {base.acceptance:.3f} "
                                         f"(drop > {th.max_acceptance_drop:g})"))
    for code, name, limit in (("tpot_p50", "tpot_p50", th.max_tpot_p50_ratio),
                              ("tpot_p99", "tpot_p99", th.max_tpot_p99_ratio)):
        mine, theirs = getattr(cand, name), getattr(base, name)
        if mine is not None and theirs is not None and theirs > 0 and mine / theirs > limit:
            found.append((code, f"TPOT {name[5:]} {_fmt(mine, 1e3, ' ms')} vs baseline {_fmt(theirs, 1e3, ' ms')} "
                                f"(ratio {mine / theirs:.2f} > {limit:g})"))
    if cand.error_rate - base.error_rate > th.max_error_rate_increase:
        found.append(("error_rate", f"error rate {cand.error_rate:.3f} vs baseline {base.error_rate:.3f} "
                                    f"(increase > {th.max_error_rate_increase:g})"))
    return found


def evaluate(base: ArmSummary, cand: ArmSummary, th: Thresholds, draft_canary: bool = False) -> Verdict:
    """The verdict on one candidate arm against the baseline (see the module docstring for the rules)."""
    greedy = _greedy_regression(base, cand, th)
    if greedy is not None and min(cand.sessions, base.sessions) < th.min_sessions:
        return Verdict(ROLLBACK, "greedy_mismatch", (greedy,))
    if cand.sessions < th.min_sessions or base.sessions < th.min_sessions:
        return Verdict(HOLD, "min_sessions", (f"waiting for sessions: candidate {cand.sessions}, baseline "
                                              f"{base.sessions} (need {th.min_sessions} each)",))
    found = ([("greedy_mismatch", greedy)] if greedy is not None else []) + regressions(base, cand, th)
    if found:
        return Verdict(ROLLBACK, found[0][0], tuple(reason for _, reason in found))
    if draft_canary and cand.greedy_checks < th.min_greedy_checks:
        return Verdict(HOLD, "min_greedy_checks", (f"waiting for greedy checks: {cand.greedy_checks} "
                                                   f"(need {th.min_greedy_checks})",))
    return Verdict(PROMOTE, "healthy", (
        f"healthy over {cand.sessions} sessions: acceptance {_fmt(cand.acceptance)} vs {_fmt(base.acceptance)}, "
        f"TPOT p50 {_fmt(cand.tpot_p50, 1e3, ' ms')} vs {_fmt(base.tpot_p50, 1e3, ' ms')}, "
        f"p99 {_fmt(cand.tpot_p99, 1e3, ' ms')} vs {_fmt(base.tpot_p99, 1e3, ' ms')}, "
        f"errors {cand.error_rate:.3f} vs {base.error_rate:.3f}, greedy checks {cand.greedy_checks}",))
