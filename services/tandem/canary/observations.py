"""Per-request outcomes of an arm and their summary: acceptance, TPOT p50/p99, error rate, greedy checks.

Outcomes are stored as compact JSON in a rolling window per arm (the newest N; see store.py), shared by every
gateway replica, so the analysis sees all replicas' traffic.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

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
        """From a request's speculation stats (RequestStats.to_dict(): drafted, accepted) and monotonic times."""
        tpot = None
        if not error and first_token_at is not None and completion_tokens > 1:
            tpot = max(0.0, finished_at - first_token_at) / (completion_tokens - 1)
        return cls(session, REQUEST, int(stats.get("drafted", 0)), int(stats.get("accepted", 0)), tpot, error)

    @classmethod
    def greedy_check(cls, session: str, match: bool) -> Outcome:
        return cls(session, GREEDY_CHECK, greedy_match=match)

    def to_json(self) -> str:
        data: dict = {"s": self.session, "at": round(self.at, 3)}
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
        if "g" in data:
            return cls(data["s"], GREEDY_CHECK, greedy_match=bool(data["g"]), at=data.get("at", 0.0))
        return cls(data["s"], REQUEST, data.get("d", 0), data.get("a", 0), data.get("t"), bool(data.get("e", 0)),
                   at=data.get("at", 0.0))


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between closest ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(slots=True, frozen=True)
class ArmSummary:
    requests: int = 0
    sessions: int = 0
    errors: int = 0
    drafted: int = 0
    accepted: int = 0
    tpot_p50: float | None = None
    tpot_p99: float | None = None
    greedy_checks: int = 0
    greedy_mismatches: int = 0

    def __post_init__(self) -> None:
        if min(self.requests, self.sessions, self.errors, self.drafted, self.accepted, self.greedy_checks,
               self.greedy_mismatches) < 0:
            raise InvalidArgument("summary: counts must be non-negative")
        if self.errors > self.requests or self.accepted > self.drafted or self.greedy_mismatches > self.greedy_checks:
            raise InvalidArgument("summary: errors <= requests, accepted <= drafted, mismatches <= checks")

    @property
    def acceptance(self) -> float | None:
        """Accepted / drafted tokens over the window; None when nothing was drafted."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    @property
    def greedy_mismatch_rate(self) -> float:
        return self.greedy_mismatches / self.greedy_checks if self.greedy_checks else 0.0

    def to_dict(self) -> dict:
        def rounded(value: float | None) -> float | None:
            return None if value is None else round(value, 6)

        return {"requests": self.requests, "sessions": self.sessions, "errors": self.errors,
                "error_rate": round(self.error_rate, 6), "drafted": self.drafted, "accepted": self.accepted,
                "acceptance": rounded(self.acceptance), "tpot_p50_s": rounded(self.tpot_p50),
                "tpot_p99_s": rounded(self.tpot_p99), "greedy_checks": self.greedy_checks,
                "greedy_mismatches": self.greedy_mismatches}


def summarize(outcomes: Iterable[Outcome]) -> ArmSummary:
    requests = errors = drafted = accepted = checks = mismatches = 0
    sessions: set[str] = set()
    tpots: list[float] = []
    for outcome in outcomes:
        if outcome.kind == GREEDY_CHECK:
            checks += 1
            mismatches += int(not outcome.greedy_match)
            continue
        requests += 1
        sessions.add(outcome.session)
        errors += int(outcome.error)
        drafted += outcome.drafted
        accepted += outcome.accepted
        if outcome.tpot_s is not None:
            tpots.append(outcome.tpot_s)
    return ArmSummary(requests, len(sessions), errors, drafted, accepted, percentile(tpots, 50.0),
                      percentile(tpots, 99.0), checks, mismatches)
