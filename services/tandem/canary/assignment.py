"""Sticky arm choice: a session's point in [0, 1) (a keyed hash of its tenant and id) against the arms' cumulative
weights.

The point is HMAC-SHA256 keyed with a server secret (secret.py), not a plain hash: with a public hash anyone could
compute which session ids land on the candidate and pick them, to steer the analysis with traffic of their choosing.
HMAC output is uniform and fixed for a fixed secret, so the split follows the weights and a session keeps its point;
every gateway replica holding the same secret computes the same point, so the session keeps its arm whichever replica
serves it. The tenant is part of the key: the same session id in two tenants is two sessions, placed independently.

The baseline arm comes first, so while a candidate ramps up (5% -> 25% -> ...) sessions only ever move from the
baseline to the candidate, never back; a rollback moves the candidate's sessions to the baseline.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.canary.arms import ArmSpec

_SCALE = float(1 << 64)


@dataclass(slots=True, frozen=True)
class Assignment:
    """The arm a request runs on, and what its outcome is recorded under."""

    arm: ArmSpec
    baseline: ArmSpec
    key: str  # what the request was bucketed by (tenant and session, else request id, else random)
    generation: int
    fallback: bool = False  # the chosen arm is not served here; `arm` is the replica's substitute (not recorded)
    tenant: str = ""  # the caller's tenant ("" without API keys), stamped on the outcomes recorded for it

    @property
    def session(self) -> str:
        return short_hash(self.key)


def session_point(key: str, secret: bytes, salt: str = "") -> float:
    """A stable, uniformly spread point in [0, 1) for `key`: HMAC-SHA256 keyed with `secret`, so only holders of the
    secret (the gateway replicas) can compute it; `salt` (the deployment) gives each use its own points."""
    digest = hmac.new(secret, f"{salt}\x00{key}".encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big") / _SCALE


def session_key(session_id: str, request_id: str = "", tenant: str = "") -> str:
    """What a request is bucketed by: the tenant's session, else its request id, else a random key (no
    stickiness). The tenant goes first with its length, so no (tenant, id) pair can spell another's key."""
    scope = f"{len(tenant)}:{tenant}:"
    if session_id:
        return "s:" + scope + session_id
    if request_id:
        return "r:" + scope + request_id
    return "x:" + secrets.token_hex(8)


def ordered(arms: Sequence[ArmSpec], baseline: str) -> list[ArmSpec]:
    """The baseline first, then the others in their stored order."""
    return [arm for arm in arms if arm.name == baseline] + [arm for arm in arms if arm.name != baseline]


def choose_arm(arms: Sequence[ArmSpec], point: float) -> ArmSpec:
    """The arm whose cumulative-weight interval holds `point`; arms at weight 0 are never chosen."""
    if not arms:
        raise ValueError("no arms to choose from")
    total = sum(arm.weight for arm in arms)
    if total <= 0:
        return arms[0]
    edge = 0.0
    for arm in arms:
        edge += arm.weight / total
        if arm.weight > 0 and point < edge:
            return arm
    return next(arm for arm in reversed(arms) if arm.weight > 0)  # float rounding at the top edge


def short_hash(key: str) -> str:
    """A short, non-reversible id for a session in stored observations."""
    return hashlib.sha256(key.encode()).hexdigest()[:12]
