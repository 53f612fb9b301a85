"""How far a batch speculates this round, priced with the measured costs of batched forwards.

Each session's policy picks its own k from single-sequence costs. In a batch the round's cost is shared: every
row is padded to the widest block, so the target forward feeds rows x (max k + 1) tokens, and drafting runs max k
steps. On hardware where a forward's cost grows with the tokens it feeds (a CPU, a saturated GPU), the best batch
round drafts less than the sessions would alone, or nothing: plain decoding of the whole batch. The plan caps
every row's k at the cap c in 0..max k that maximises expected tokens per second,

    sum_i E(alpha_i, k_i') / (sum_{s=1..c} T_draft(rows with k_i' >= s) + T_target(rows x (max_i k_i' + 1))),
    k_i' = min(k_i, c),

with E(a, k) = (1 - a^(k+1)) / (1 - a) as in the per-session policy. c = 0 gives rows / T_target(rows).
"""

from __future__ import annotations

from tandem.core.costs import CostModel
from tandem.core.policy import expected_tokens


def predicted_rate(ks: list[int], alphas: list[float], costs: CostModel) -> float:
    """Expected tokens per second of one round in which row i drafts ks[i] tokens."""
    widest = max(ks, default=0)
    seconds = costs.batch_forward_time(len(ks), widest + 1)
    seconds += sum(costs.draft_time(sum(k >= step for k in ks)) for step in range(1, widest + 1))
    return sum(expected_tokens(a, k) for a, k in zip(alphas, ks, strict=True)) / seconds


def plan_batch(ks: list[int], alphas: list[float], costs: CostModel, margin: float = 0.05) -> list[int]:
    """Each row's k capped at the best common cap; plain (all 0) unless speculating wins by `margin`."""
    if len(ks) <= 1 or not any(ks) or not costs.calibrated:
        return ks
    plain = predicted_rate([0] * len(ks), alphas, costs)
    best_cap, best_rate = 0, plain * (1.0 + margin)
    for cap in range(1, max(ks) + 1):
        rate = predicted_rate([min(k, cap) for k in ks], alphas, costs)
        if rate > best_rate:
            best_cap, best_rate = cap, rate
    return [min(k, best_cap) for k in ks]
