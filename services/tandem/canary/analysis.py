"""The automatic analysis: compare a candidate arm with the baseline and say hold, promote one step, or roll back.

Pure functions of the two arms' windows and the thresholds, so they are tested with known inputs. `judge` takes the
windows' outcomes: it summarizes each arm with every tenant capped at `max_tenant_share` of each statistic's weight
(tenants.py), runs `evaluate` on the summaries, and lets the verdict stand only if no single tenant decides it (below).
`evaluate`'s rules, in order:

1. Greedy mismatch. With a clean baseline (no mismatches of its own) and zero tolerance, one mismatch rolls back at
   once: the speculative core is exact, so a draft canary whose greedy output differs from plain decoding is broken.
   Where the baseline mismatches too (bf16 near-ties, see README), the mismatch rates are compared once both arms
   have `min_greedy_checks` checks.
2. Fewer than `min_sessions` sessions on either arm: hold.
3. Any regression beyond its threshold rolls back, naming every one: acceptance drop (absolute), TPOT p50 and p99
   ratios, error-rate increase (absolute).
4. A draft canary still short of `min_greedy_checks` checks: hold. Otherwise: promote one step.

No single tenant decides (with max_tenant_share below 1): the cap bounds a tenant's weight, but a capped tenant still
moves a p99 (1% of the weight does), a mean, and even a median; so a promote or rollback verdict is also reached with
each tenant's observations left out in turn, and where leaving one tenant out changes the action, the verdict is hold
(code `tenant_skew`): one tenant's traffic alone may neither roll a candidate back that the others see as fine, nor
promote one that the others see as bad. A conclusive greedy mismatch (exact numerics) is exempt: the output differs
from plain decoding whoever sent the prompt. With one tenant (no API keys) there is no one to leave out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass

from tandem.canary.observations import ArmSummary, Outcome, Window, count_text
from tandem.errors import InvalidArgument

HOLD = "hold"
PROMOTE = "promote"
ROLLBACK = "rollback"
TENANT_SKEW = "tenant_skew"
# Tenants holding less than this of every statistic's weight in both arms are not left out one by one: such a tenant
# moves a rate by under 1% of its range and a percentile by at most about one percentile rank of the others' traffic;
# the bound also keeps the leave-one-out work small (at most 100 tenants per statistic and arm).
LEAVE_OUT_MIN_SHARE = 0.01
DEFAULT_MAX_TENANT_SHARE = 0.25


@dataclass(slots=True, frozen=True)
class Thresholds:
    min_sessions: int = 50
    max_acceptance_drop: float = 0.10
    max_tpot_p50_ratio: float = 1.10
    max_tpot_p99_ratio: float = 1.25
    max_error_rate_increase: float = 0.01
    greedy_mismatch_tolerance: float = 0.0
    min_greedy_checks: int = 0
    # The most of an arm's weight one tenant may hold in each statistic, and below 1 no single tenant decides a verdict
    # (see the module docstring). 1: tenants are pooled as they come (one tenant may carry an arm, and decide alone).
    max_tenant_share: float = DEFAULT_MAX_TENANT_SHARE

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
        share = self.max_tenant_share
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0.0 < share <= 1.0:
            raise InvalidArgument(f"max_tenant_share: must be in (0, 1], got {share!r}")

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        # Left out at its default: gateways from before this field reject unknown thresholds in the shared state, and
        # would stop reading it while a rollout runs both versions. Set explicitly, it is stored.
        if data["max_tenant_share"] == DEFAULT_MAX_TENANT_SHARE:
            del data["max_tenant_share"]
        return data

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


def _conclusive_greedy(base: ArmSummary, cand: ArmSummary, th: Thresholds) -> bool:
    """Exact numerics (a clean baseline, zero tolerance): one candidate mismatch is conclusive."""
    return bool(cand.greedy_mismatches) and base.greedy_mismatches == 0 and th.greedy_mismatch_tolerance == 0.0


def _greedy_regression(base: ArmSummary, cand: ArmSummary, th: Thresholds) -> str | None:
    if not cand.greedy_mismatches:
        return None
    text = (f"greedy output differs from plain decoding in {count_text(cand.greedy_mismatches)}/"
            f"{count_text(cand.greedy_checks)} checks")
    if _conclusive_greedy(base, cand, th):
        return text
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
        return Verdict(HOLD, "min_sessions", (f"waiting for sessions: candidate {count_text(cand.sessions)}, "
                                              f"baseline {count_text(base.sessions)} (need {th.min_sessions} each)",))
    found = ([("greedy_mismatch", greedy)] if greedy is not None else []) + regressions(base, cand, th)
    if found:
        return Verdict(ROLLBACK, found[0][0], tuple(reason for _, reason in found))
    if draft_canary and cand.greedy_checks < th.min_greedy_checks:
        return Verdict(HOLD, "min_greedy_checks", (f"waiting for greedy checks: {count_text(cand.greedy_checks)} "
                                                   f"(need {th.min_greedy_checks})",))
    return Verdict(PROMOTE, "healthy", (
        f"healthy over {count_text(cand.sessions)} sessions: acceptance {_fmt(cand.acceptance)} vs "
        f"{_fmt(base.acceptance)}, "
        f"TPOT p50 {_fmt(cand.tpot_p50, 1e3, ' ms')} vs {_fmt(base.tpot_p50, 1e3, ' ms')}, "
        f"p99 {_fmt(cand.tpot_p99, 1e3, ' ms')} vs {_fmt(base.tpot_p99, 1e3, ' ms')}, "
        f"errors {cand.error_rate:.3f} vs {base.error_rate:.3f}, greedy checks {count_text(cand.greedy_checks)}",))


def _tenant_name(tenant: str) -> str:
    return repr(tenant) if tenant else "(anonymous)"


def _heavy_tenants(*windows: Window) -> list[str]:
    """Tenants holding at least LEAVE_OUT_MIN_SHARE of some statistic's weight (requests, timed requests, drafted
    tokens, sessions, greedy checks) in either window, heaviest first; none when the windows hold fewer than two
    tenants (leaving the only one out leaves nothing to judge)."""
    weights = (lambda t: t.requests, lambda t: t.timed, lambda t: t.drafted, lambda t: len(t.sessions),
               lambda t: t.checks)
    shares: dict[str, float] = {}
    for window in windows:
        for weight in weights:
            total = sum(weight(sums) for sums in window.tenants.values())
            for tenant, sums in window.tenants.items():
                shares[tenant] = max(shares.get(tenant, 0.0), weight(sums) / total if total else 0.0)
    if len(shares) < 2:
        return []
    return sorted((tenant for tenant, share in shares.items() if share >= LEAVE_OUT_MIN_SHARE), key=shares.__getitem__,
                  reverse=True)


def judge(base: Iterable[Outcome], cand: Iterable[Outcome], th: Thresholds,
          draft_canary: bool = False) -> tuple[Verdict, ArmSummary, ArmSummary]:
    """The verdict on a candidate from both arms' outcomes, tenant-capped and checked for a deciding tenant (module
    docstring), with the two summaries it judged."""
    share = th.max_tenant_share
    base_window, cand_window = Window(base), Window(cand)
    base_summary, cand_summary = base_window.summary(share), cand_window.summary(share)
    verdict = evaluate(base_summary, cand_summary, th, draft_canary)
    if verdict.action == HOLD or share >= 1.0 or _conclusive_greedy(base_summary, cand_summary, th):
        return verdict, base_summary, cand_summary
    for tenant in _heavy_tenants(base_window, cand_window):
        without = evaluate(base_window.summary(share, tenant) if tenant in base_window.tenants else base_summary,
                           cand_window.summary(share, tenant) if tenant in cand_window.tenants else cand_summary,
                           th, draft_canary)
        if without.action != verdict.action:
            reason = (f"{verdict.action} ({verdict.code}) rests on tenant {_tenant_name(tenant)}'s traffic: without "
                      f"it, {without.action} ({without.code}: {'; '.join(without.reasons)})")
            return Verdict(HOLD, TENANT_SKEW, (reason, *verdict.reasons)), base_summary, cand_summary
    return verdict, base_summary, cand_summary
