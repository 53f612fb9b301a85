"""Which rows of a batch speculate this round, and how far, priced with the measured costs of batched forwards.

Each session's policy picks its own k from single-sequence costs, and whether it drafts at all. In a batch the
round's cost is shared: one target forward over every row, and one draft step over the rows still drafting for each
of the max k steps. The target runs rows of different widths padded to the widest block, or packed one after another
where that pays (core.row_layout: on a CPU, from a few padded tokens, outside a compiled runner's static forwards);
the plan prices the forward as its runner lays it out (the target's RowLayout in the cost model), as a uniform
forward of width w(c), the widest block (k + 1 tokens) where padded and the mean block where packed, over as many
rows (a compiled runner's row bucket: 7 rows run and are priced as 8). On hardware where a forward's cost grows with the
tokens it feeds (a CPU, a saturated GPU), the best round may draft less than the sessions would alone, or nothing;
where a draft step over more rows costs little more, rows may draft further than they would alone, since their mates
pay for the steps and the padding. For each cap c up to the widest limit L_i
(the most row i may draft: k_max, its request's cap, its tokens left) the plan takes k_i' = min(L_i, c) for the rows
whose session drafts (0 for the others and for the rows it drops, below),

    rate(c) = sum_i E(alpha_i, k_i') / T(c),
    T(c) = sum_{s=1..c} T_draft(rows with k_i' >= s) + T_target(rows x w(c)) + sum_{i: k_i' > 0} C_i,

with E(a, k) = (1 - a^(k+1)) / (1 - a) as in the per-session policy, and keeps the cap with the best rate if it
beats plain decoding of the whole batch (rows / T(0)) by a margin. Within a cap, a row's drafting is dropped (k_i' = 0)
where the batch's rate rises without it: a row that would widen the forward, lengthen the draft steps or pay a
catch-up for fewer extra tokens than that time decodes. A row is not dropped merely for gaining less than plain
decoding would alone: beside drafting mates the round lasts T(c) whether it drafts or not, and where a draft step
over one more row and a padded verification cost next to nothing (a CPU, a GPU below saturation), its drafts come
nearly free. Rows at 0 (these, and sessions in fallback) decode plainly in the same forward as their drafting mates:
the batch's tokens per second is what is maximised, so such a row may wait for its mates' drafts.

C_i is row i's drafter catch-up: a row whose drafter is behind (its prompt, tokens decoded plainly) first runs a
draft forward over those tokens, which stalls the whole batch. It is paid once and lets the row draft from then on,
so it is spread over the rounds the row has left (at most `CATCH_UP_HORIZON`). Once the deployment has measured
its acceptance, core.round_plan charges it whole instead to a row that is only explored (never drafted, and
drafting only at its optimistic acceptance).
"""

from __future__ import annotations

from tandem.core.costs import CostModel
from tandem.core.policy import expected_tokens
from tandem.core.prediction import MOST_ACCEPTANCE

CATCH_UP_HORIZON = 16


class Prices:
    """One plan's view of a CostModel: each batched forward's and each draft step's price worked out once. A plan
    prices hundreds of rounds over the same few shapes while the tables stand still, and a price on a robust line
    sorts every pairwise slope: at 8 rows on CPU-A a plan took 0.73-1.44 ms asking the model each time, 0.49-0.79 ms
    so (docs/bench/plan-prices-v1.json), beside a step of about 0.12 s there, a GPU's of a few ms. Anything else is
    read from the model itself."""

    __slots__ = ("_drafts", "_forwards", "costs")

    def __init__(self, costs: CostModel) -> None:
        self.costs = costs
        self._forwards: dict[tuple[int, int], float] = {}
        self._drafts: dict[int, float] = {}

    def __getattr__(self, name: str) -> object:
        return getattr(self.costs, name)

    def batch_forward_time(self, rows: int, width: int) -> float:
        if (seconds := self._forwards.get((rows, width))) is None:
            seconds = self._forwards[rows, width] = self.costs.batch_forward_time(rows, width)
        return seconds

    def draft_time(self, rows: int) -> float:
        if (seconds := self._drafts.get(rows)) is None:
            seconds = self._drafts[rows] = self.costs.draft_time(rows)
        return seconds


def prices(costs: CostModel | Prices) -> Prices:
    """`costs` as one plan's Prices (as it is, where it already is)."""
    return costs if isinstance(costs, Prices) else Prices(costs)


def catch_up_share(costs: CostModel | Prices, behind: int, alpha: float, k: int, remaining: int) -> float:
    """Seconds of a row's drafter catch-up charged to one round: the catch-up over the rounds the row has left."""
    seconds = costs.catch_up_time(behind)
    if not seconds or k <= 0:
        return seconds
    rounds_left = min(max(remaining / expected_tokens(alpha, k), 1.0), CATCH_UP_HORIZON)
    return seconds / rounds_left


def round_seconds(ks: list[int], costs: CostModel | Prices, catch_up: list[float] | None = None,
                  free: list[int] | None = None) -> float:
    """Expected seconds of one round in which row i drafts ks[i] tokens (catch_up: seconds per row) and verifies
    free[i] tokens that took no draft step (a prediction's, a looked-up block: core.round_plan rule 0)."""
    blocks = [max(k, f) + 1 for k, f in zip(ks, free or [0] * len(ks), strict=True)]
    width = costs.layout.priced_width(blocks) if costs.layout and len(ks) > 1 else max(blocks, default=1)
    seconds = costs.batch_forward_time(len(ks), width)
    seconds += sum(costs.draft_time(sum(k >= step for k in ks)) for step in range(1, max(ks, default=0) + 1))
    return seconds + sum(c for c, k in zip(catch_up or [0.0] * len(ks), ks, strict=True) if k > 0)


def free_blocks_that_pay(ks: list[int], alphas: list[float], offered: list[int], offered_alphas: list[float],
                         costs: CostModel | Prices, catch_up: list[float] | None = None) -> list[int]:
    """Per row, how many of its free drafts (offered[i]: a prediction's or a looked-up block, accepted at
    offered_alphas[i]) it verifies this round beside the drafting rows' ks: a free block takes no draft step but
    widens the batch's target forward, where a refused one costs every row (on CPU-A, 8 rows at once decoded 0.8x
    as fast with every row's looked-up block taken as if it were alone). Each row's block, the most extra tokens
    first, is kept at the length that raises the batch's expected tokens per second most, if any does."""
    if len(ks) <= 1 or not any(offered):
        return list(offered)
    costs = prices(costs)

    def rate(free: list[int]) -> float:
        tokens = sum(expected_tokens(a, k) if k else expected_tokens(min(fa, MOST_ACCEPTANCE), f)
                     for a, k, fa, f in zip(alphas, ks, offered_alphas, free, strict=True))
        return tokens / round_seconds(ks, costs, catch_up, free)

    kept = [0] * len(ks)
    best = rate(kept)
    for i in sorted((i for i, f in enumerate(offered) if f),
                    key=lambda i: -expected_tokens(offered_alphas[i], offered[i])):
        for k in range(offered[i], 0, -1):
            trial = kept[:i] + [k] + kept[i + 1:]
            if (trial_rate := rate(trial)) > best:
                kept, best = trial, trial_rate
    return kept


def predicted_rate(ks: list[int], alphas: list[float], costs: CostModel | Prices,
                   catch_up: list[float] | None = None) -> float:
    """Expected tokens per second of one round in which row i drafts ks[i] tokens."""
    return sum(expected_tokens(a, k) for a, k in zip(alphas, ks, strict=True)) / round_seconds(ks, costs, catch_up)


def plan_batch(ks: list[int], alphas: list[float], costs: CostModel | Prices, catch_up: list[float] | None = None,
               margin: float = 0.05, limits: list[int] | None = None) -> list[int]:
    """Each row's k: the best cap within its limit (limits: the most each row may draft, else its session's own k)
    for the rows whose session drafts (ks[i] > 0), 0 for the rows whose drafting costs the batch more than it
    brings; plain (all 0) unless speculating beats it by `margin`."""
    if len(ks) <= 1 or not any(ks) or not costs.calibrated:
        return ks
    costs = prices(costs)
    limits = [limit if k else 0 for k, limit in zip(ks, limits or ks, strict=True)]
    shares = catch_up or [0.0] * len(ks)
    best, best_rate = [0] * len(ks), len(ks) / round_seconds([0] * len(ks), costs) * (1.0 + margin)
    for cap in range(1, max(limits) + 1):
        capped = [min(limit, cap) for limit in limits]
        rate = predicted_rate(capped, alphas, costs, shares)
        # Rows least worth their drafting first: the fewest extra tokens, net of what their catch-up's seconds
        # would have decoded at this rate. Each is dropped only where the batch's rate rises without it.
        for i in sorted((i for i, k in enumerate(capped) if k),
                        key=lambda i: expected_tokens(alphas[i], capped[i]) - 1.0 - rate * shares[i]):
            without = capped[:i] + [0] + capped[i + 1:]
            if not any(without) or (rate_without := predicted_rate(without, alphas, costs, shares)) <= rate:
                break
            capped, rate = without, rate_without
        if any(capped) and rate > best_rate:
            best, best_rate = capped, rate
    return best
