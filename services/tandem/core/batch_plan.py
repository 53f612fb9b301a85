"""How far a batch speculates this round, priced with the measured costs of batched forwards.

Each session's policy picks its own k from single-sequence costs. In a batch the round's cost is shared: every
row is padded to the widest block, so the target forward feeds rows x (max k + 1) tokens, and drafting runs max k
steps. On hardware where a forward's cost grows with the tokens it feeds (a CPU, a saturated GPU), the best batch
round drafts less than the sessions would alone, or nothing: plain decoding of the whole batch. The plan caps
every row's k at the cap c in 0..max k that maximises expected tokens per second,

    sum_i E(alpha_i, k_i') / T(c),
    T(c) = sum_{s=1..c} T_draft(rows with k_i' >= s) + T_target(rows x (max_i k_i' + 1)) + sum_{i: k_i' > 0} C_i,
    k_i' = min(k_i, c),

with E(a, k) = (1 - a^(k+1)) / (1 - a) as in the per-session policy; c = 0 is plain decoding, rows / T(0).
A cap is allowed only if every row gains from it: E(alpha_i, k_i') / T(c) >= 1 / T(0). A row that does not draft
(its session is in fallback, or its drafter is too far behind) would only wait for the others' drafts, so one such
row keeps the whole batch plain; speculation never makes a session slower than plain decoding would.

C_i is row i's drafter catch-up: a row whose drafter is behind (its prompt, tokens decoded plainly) first runs a
draft forward over those tokens, which stalls the whole batch. It is paid once and lets the row draft from then on,
so it is spread over the rounds the row has left (at most `CATCH_UP_HORIZON`).
"""

from __future__ import annotations

from tandem.core.costs import CostModel
from tandem.core.policy import expected_tokens

CATCH_UP_HORIZON = 16


def catch_up_share(costs: CostModel, behind: int, alpha: float, k: int, remaining: int) -> float:
    """Seconds of a row's drafter catch-up charged to one round: the catch-up over the rounds the row has left."""
    seconds = costs.catch_up_time(behind)
    if not seconds or k <= 0:
        return seconds
    rounds_left = min(max(remaining / expected_tokens(alpha, k), 1.0), CATCH_UP_HORIZON)
    return seconds / rounds_left


def round_seconds(ks: list[int], costs: CostModel, catch_up: list[float] | None = None) -> float:
    """Expected seconds of one round in which row i drafts ks[i] tokens (catch_up: seconds per row)."""
    widest = max(ks, default=0)
    seconds = costs.batch_forward_time(len(ks), widest + 1)
    seconds += sum(costs.draft_time(sum(k >= step for k in ks)) for step in range(1, widest + 1))
    return seconds + sum(c for c, k in zip(catch_up or [0.0] * len(ks), ks, strict=True) if k > 0)


def predicted_rate(ks: list[int], alphas: list[float], costs: CostModel, catch_up: list[float] | None = None) -> float:
    """Expected tokens per second of one round in which row i drafts ks[i] tokens."""
    return sum(expected_tokens(a, k) for a, k in zip(alphas, ks, strict=True)) / round_seconds(ks, costs, catch_up)


def plan_batch(ks: list[int], alphas: list[float], costs: CostModel, catch_up: list[float] | None = None,
               margin: float = 0.05) -> list[int]:
    """Each row's k capped at the best common cap that every row gains from; plain (all 0) unless speculating wins
    by `margin`."""
    if len(ks) <= 1 or not any(ks) or not costs.calibrated:
        return ks
    plain_seconds = round_seconds([0] * len(ks), costs)
    best, best_rate = [0] * len(ks), len(ks) / plain_seconds * (1.0 + margin)
    for cap in range(1, max(ks) + 1):
        capped = [min(k, cap) for k in ks]
        tokens = [expected_tokens(a, k) for a, k in zip(alphas, capped, strict=True)]
        seconds = round_seconds(capped, costs, catch_up)
        rate = sum(tokens) / seconds
        if min(tokens) / seconds >= 1.0 / plain_seconds and rate > best_rate:
            best, best_rate = capped, rate
    return best
