"""Which rows of a batch speculate this round, and how far, priced with the measured costs of batched forwards.

Each session's policy picks its own k from single-sequence costs. In a batch the round's cost is shared: one
target forward over every row, each padded to the widest block (rows x (max k + 1) tokens fed), and one draft step
over the rows still drafting for each of the max k steps. On hardware where a forward's cost grows with the tokens
it feeds (a CPU, a saturated GPU), the best round drafts less than the sessions would alone, or nothing. For each
cap c in 1..max k the plan takes k_i' = min(k_i, c) for the rows that gain from drafting and 0 for the others,

    rate(c) = sum_i E(alpha_i, k_i') / T(c),
    T(c) = sum_{s=1..c} T_draft(rows with k_i' >= s) + T_target(rows x (max_i k_i' + 1)) + sum_{i: k_i' > 0} C_i,

with E(a, k) = (1 - a^(k+1)) / (1 - a) as in the per-session policy, and keeps the cap with the best rate if it
beats plain decoding of the whole batch (rows / T(0)) by a margin. A row gains when E(alpha_i, k_i') / T(c) >=
1 / T(0); while some row does not (a low acceptance, a costly catch-up), the costliest such row is set to 0 and
T(c) priced again, until every drafting row gains. Rows at 0 (these, and sessions in fallback) decode plainly in
the same forward as their drafting mates: the batch's tokens per second is what is maximised, so such a row may
wait for its mates' drafts.

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
    """Each row's k: capped at the best cap for the rows that gain from drafting, 0 for the others; plain (all 0)
    unless speculating beats it by `margin`."""
    if len(ks) <= 1 or not any(ks) or not costs.calibrated:
        return ks
    plain_seconds = round_seconds([0] * len(ks), costs)
    best, best_rate = [0] * len(ks), len(ks) / plain_seconds * (1.0 + margin)
    for cap in range(1, max(ks) + 1):
        capped = [min(k, cap) for k in ks]
        while any(capped):
            seconds = round_seconds(capped, costs, catch_up)
            tokens = [expected_tokens(a, k) for a, k in zip(alphas, capped, strict=True)]
            losers = [i for i, k in enumerate(capped) if k and tokens[i] / seconds < 1.0 / plain_seconds]
            if not losers:
                break
            # One at a time, the costliest first (its catch-up), then the one expecting least: dropping a row
            # shortens the round, so the others may gain once it is gone.
            capped[max(losers, key=lambda i: (catch_up[i] if catch_up else 0.0, -tokens[i]))] = 0
        if any(capped) and (rate := sum(tokens) / seconds) > best_rate:
            best, best_rate = capped, rate
    return best
