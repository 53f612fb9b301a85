"""Per-request outcomes of an arm and their summary: acceptance, TPOT p50/p99, error rate, greedy checks.

Outcomes are stored as compact JSON in a rolling window per arm (the newest N; see store.py), shared by every
gateway replica, so the analysis sees all replicas' traffic. Each carries its tenant (the API key's; "" without
keys), so a summary can cap every tenant's share of the arm's statistics (tenants.py).
"""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from tandem.canary.tenants import capped_total, tenant_factors, weighted_percentiles
from tandem.errors import InvalidArgument

REQUEST = "request"
GREEDY_CHECK = "greedy"


@dataclass(slots=True, frozen=True)
class Outcome:
    """One finished request (kind "request") or one greedy-equality check (kind "greedy", `greedy_match` set)."""

    session: str  # a short hash of the session key (assignment.short_hash)
    kind: str = REQUEST
    drafted: int = 0
    accepted: int = 0
    tpot_s: float | None = None  # (finish - first token) / (completion tokens - 1); None with fewer than 2 tokens
    error: bool = False
    greedy_match: bool | None = None
    at: float = field(default_factory=time.time)
    tenant: str = ""  # the caller's tenant ("" without API keys: one anonymous tenant); stamped by the controller

    def __post_init__(self) -> None:
        if self.kind not in (REQUEST, GREEDY_CHECK):
            raise InvalidArgument(f"kind: must be {REQUEST!r} or {GREEDY_CHECK!r}, got {self.kind!r}")
        if not 0 <= self.accepted <= self.drafted:
            raise InvalidArgument(f"accepted: must be between 0 and drafted ({self.drafted}), got {self.accepted}")
        if self.tpot_s is not None and not (math.isfinite(self.tpot_s) and self.tpot_s >= 0):
            raise InvalidArgument(f"tpot_s: must be a non-negative number, got {self.tpot_s!r}")
        if (self.kind == GREEDY_CHECK) != (self.greedy_match is not None):
            raise InvalidArgument("greedy_match: set exactly on greedy-check outcomes")

    @classmethod
    def from_request(cls, session: str, stats: dict, first_token_at: float | None, finished_at: float,
                     completion_tokens: int, error: bool = False) -> Outcome:
        """From a request's speculation stats (core.stats.SpeculationReport: drafted, accepted) and monotonic times."""
        tpot = None
        if not error and first_token_at is not None and completion_tokens > 1:
            tpot = max(0.0, finished_at - first_token_at) / (completion_tokens - 1)
        return cls(session, REQUEST, int(stats.get("drafted", 0)), int(stats.get("accepted", 0)), tpot, error)

    @classmethod
    def greedy_check(cls, session: str, match: bool) -> Outcome:
        return cls(session, GREEDY_CHECK, greedy_match=match)

    def to_json(self) -> str:
        data: dict = {"s": self.session, "at": round(self.at, 3)}
        if self.tenant:
            data["tn"] = self.tenant
        if self.kind == GREEDY_CHECK:
            data["g"] = int(bool(self.greedy_match))
        else:
            data |= {"d": self.drafted, "a": self.accepted, "e": int(self.error)}
            if self.tpot_s is not None:
                data["t"] = round(self.tpot_s, 6)
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Outcome:
        data = json.loads(text)
        tenant = str(data.get("tn", ""))  # absent in outcomes stored before tenants: the anonymous tenant
        if "g" in data:
            return cls(data["s"], GREEDY_CHECK, greedy_match=bool(data["g"]), at=data.get("at", 0.0), tenant=tenant)
        return cls(data["s"], REQUEST, data.get("d", 0), data.get("a", 0), data.get("t"), bool(data.get("e", 0)),
                   at=data.get("at", 0.0), tenant=tenant)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between closest ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def count_text(value: float) -> str:
    """A (possibly tenant-weighted) count for a reason or a table: whole numbers as such, else one decimal."""
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"


@dataclass(slots=True, frozen=True)
class ArmSummary:
    """An arm's window as the analysis judges it. With a tenant cap (summarize's max_tenant_share below 1) the counts
    are tenant-weighted sums, so fractional: `sessions` is what min_sessions compares with, and the rates and
    percentiles give no tenant more than the cap. `observed` is the plain number of requests, `tenants` how many
    tenants sent them."""

    requests: float = 0
    sessions: float = 0
    errors: float = 0
    drafted: float = 0
    accepted: float = 0
    tpot_p50: float | None = None
    tpot_p99: float | None = None
    greedy_checks: float = 0
    greedy_mismatches: float = 0
    observed: int | None = None  # requests before weighting; None: the same as `requests`
    tenants: int = 0

    def __post_init__(self) -> None:
        if min(self.requests, self.sessions, self.errors, self.drafted, self.accepted, self.greedy_checks,
               self.greedy_mismatches) < 0:
            raise InvalidArgument("summary: counts must be non-negative")
        slack = 1e-9 * max(1.0, self.requests, self.drafted, self.greedy_checks)  # weighted sums round
        if self.errors > self.requests + slack or self.accepted > self.drafted + slack \
                or self.greedy_mismatches > self.greedy_checks + slack:
            raise InvalidArgument("summary: errors <= requests, accepted <= drafted, mismatches <= checks")

    @property
    def acceptance(self) -> float | None:
        """Accepted / drafted tokens over the window; None when nothing was drafted."""
        return min(1.0, self.accepted / self.drafted) if self.drafted else None

    @property
    def error_rate(self) -> float:
        return min(1.0, self.errors / self.requests) if self.requests else 0.0

    @property
    def greedy_mismatch_rate(self) -> float:
        return min(1.0, self.greedy_mismatches / self.greedy_checks) if self.greedy_checks else 0.0

    def to_dict(self) -> dict:
        def rounded(value: float | None) -> float | None:
            return None if value is None else round(value, 6)

        def count(value: float) -> float:
            return int(value) if float(value).is_integer() else round(value, 3)

        return {"requests": count(self.requests), "sessions": count(self.sessions), "errors": count(self.errors),
                "error_rate": round(self.error_rate, 6), "drafted": count(self.drafted),
                "accepted": count(self.accepted), "acceptance": rounded(self.acceptance),
                "tpot_p50_s": rounded(self.tpot_p50), "tpot_p99_s": rounded(self.tpot_p99),
                "greedy_checks": count(self.greedy_checks), "greedy_mismatches": count(self.greedy_mismatches),
                "observed": self.requests if self.observed is None else self.observed, "tenants": self.tenants}


class TenantSums:
    """One tenant's plain sums in a window."""

    __slots__ = ("accepted", "checks", "drafted", "errors", "mismatches", "requests", "sessions", "timed")

    def __init__(self) -> None:
        self.requests = self.errors = self.drafted = self.accepted = self.timed = self.checks = self.mismatches = 0
        self.sessions: set[str] = set()


class Window:
    """An arm's outcomes, summed per tenant once, so the analysis can summarize it again without one tenant (its
    leave-one-tenant-out check) for the price of the tenants, not the outcomes."""

    def __init__(self, outcomes: Iterable[Outcome]) -> None:
        self.tenants: dict[str, TenantSums] = defaultdict(TenantSums)
        tpots: list[tuple[float, str]] = []
        for outcome in outcomes:
            mine = self.tenants[outcome.tenant]
            if outcome.kind == GREEDY_CHECK:
                mine.checks += 1
                mine.mismatches += int(not outcome.greedy_match)
                continue
            mine.requests += 1
            mine.sessions.add(outcome.session)
            mine.errors += int(outcome.error)
            mine.drafted += outcome.drafted
            mine.accepted += outcome.accepted
            if outcome.tpot_s is not None:
                mine.timed += 1
                tpots.append((outcome.tpot_s, outcome.tenant))
        self.tpots = sorted(tpots)  # sorted once: re-sorting a filtered sorted list is linear (timsort)

    def summary(self, max_tenant_share: float = 1.0, without: str | None = None) -> ArmSummary:
        """The summary with each tenant capped at `max_tenant_share` of every statistic's weight (tenants.py; at 1,
        and with a single tenant, plain counts), leaving out tenant `without`."""
        per = {tenant: sums for tenant, sums in self.tenants.items() if tenant != without}

        def factors(weight) -> dict[str, float]:
            return tenant_factors({tenant: weight(sums) for tenant, sums in per.items()}, max_tenant_share)

        by_requests, by_drafted = factors(lambda t: t.requests), factors(lambda t: t.drafted)
        by_timed, by_checks = factors(lambda t: t.timed), factors(lambda t: t.checks)

        def total(value, factor: dict[str, float]) -> float:
            return sum(value(sums) * factor[tenant] for tenant, sums in per.items())

        p50, p99 = weighted_percentiles([(tpot, by_timed[tenant]) for tpot, tenant in self.tpots if tenant != without],
                                        (50.0, 99.0))
        return ArmSummary(total(lambda t: t.requests, by_requests),
                          capped_total({tenant: len(sums.sessions) for tenant, sums in per.items()}, max_tenant_share),
                          total(lambda t: t.errors, by_requests), total(lambda t: t.drafted, by_drafted),
                          total(lambda t: t.accepted, by_drafted), p50, p99, total(lambda t: t.checks, by_checks),
                          total(lambda t: t.mismatches, by_checks), sum(sums.requests for sums in per.values()),
                          sum(1 for sums in per.values() if sums.requests))


def summarize(outcomes: Iterable[Outcome], max_tenant_share: float = 1.0) -> ArmSummary:
    """The window's summary; below 1, `max_tenant_share` caps each tenant's share of every statistic's weight
    (tenants.py). At 1 (and with a single tenant) the counts are plain counts."""
    return Window(outcomes).summary(max_tenant_share)
