"""The batch plan (core.batch_plan): it prices a padded batched round and the drafters' catch-up, lets the rows
that gain draft beside rows that decode plainly, prices rows of different widths as the target lays them out, and lets
rows draft past their session's k within their limits."""

from __future__ import annotations

import pytest

from tandem.core import policy
from tandem.core.costs import CostModel


def test_batch_plan_prices_the_padded_batched_round() -> None:
    from tandem.core.batch_plan import plan_batch, predicted_rate

    # A forward costs 0.1 s + 0.02 s per token fed; a draft step 0.02 s + 0.01 s per row.
    costs = CostModel(draft_step=0.03, verify={n: 0.1 + 0.02 * n for n in (1, 2, 64)},
                      draft_rows={8: 0.1}, frozen=True)
    assert abs(costs.forward_time(40) - 0.9) < 1e-9 and abs(costs.draft_time(4) - 0.06) < 1e-9
    alphas = [0.8] * 8
    rate = predicted_rate([2, 1, 0, 0, 0, 0, 0, 0], alphas, costs)
    # Every row is padded to 3 tokens (24 fed), two draft steps over 2 rows then 1 row.
    expected = (policy.expected_tokens(0.8, 2) + policy.expected_tokens(0.8, 1) + 6) / (0.58 + 0.04 + 0.03)
    assert abs(rate - expected) < 1e-9
    assert plan_batch([4] * 8, alphas, costs) == [0] * 8  # 8 rows: drafting costs more than it gains
    assert plan_batch([4], [0.8], costs) == [4]  # one row is the session's own choice
    cheap = CostModel(draft_step=0.001, verify={1: 0.1, 64: 0.1001}, draft_rows={8: 0.001}, frozen=True)
    assert plan_batch([4, 3, 1, 2], [0.8] * 4, cheap) == [4, 3, 1, 2]  # memory-bound: every k pays
    middle = CostModel(draft_step=0.01, verify={n: 0.1 + 0.004 * n for n in (1, 64)}, draft_rows={8: 0.012},
                       frozen=True)
    capped = plan_batch([6] * 8, alphas, middle)
    assert 0 < max(capped) < 6 and len(set(capped)) == 1
    assert predicted_rate(capped, alphas, middle) >= max(predicted_rate([c] * 8, alphas, middle) for c in range(7))


def test_batch_plan_prices_the_drafter_catch_up() -> None:
    from tandem.core.batch_plan import CATCH_UP_HORIZON, catch_up_share, plan_batch, predicted_rate

    # Drafting pays in a batch of 4 (0.1 s forwards whatever the width, 0.01 s draft steps); a catch-up over
    # n tokens costs 0.01 s per token.
    costs = CostModel(draft_step=0.01, verify={1: 0.1, 2: 0.1}, draft_rows={4: 0.01}, batched={(4, 1): 0.1},
                      draft_forward={8: 0.08, 32: 0.32}, frozen=True)
    assert costs.catch_up_time(2) == 0.0  # two behind: both go with the first batched draft step
    assert abs(costs.catch_up_time(17) - 0.16) < 1e-12  # 16 tokens alone, the last with the batch
    # Past the widest forward measured, a backlog costs as many of those forwards as it fills, even where the
    # table is flat (a weights-bound drafter): 128 tokens are four 32-token catch-ups.
    flat = CostModel(draft_step=0.04, draft_forward={8: 0.04, 32: 0.04}, frozen=True)
    assert abs(flat.catch_up_time(129) - 0.16) < 1e-12 and flat.catch_up_time(33) == 0.04
    e = policy.expected_tokens(0.8, 2)
    assert abs(catch_up_share(costs, 17, 0.8, 2, remaining=20) - 0.16 / (20 / e)) < 1e-12
    assert abs(catch_up_share(costs, 17, 0.8, 2, remaining=1000) - 0.16 / CATCH_UP_HORIZON) < 1e-12
    alphas = [0.8] * 4
    assert plan_batch([2] * 4, alphas, costs) == [2] * 4
    rate = predicted_rate([2] * 4, alphas, costs, [0.0, 0.0, 0.0, 0.05])
    assert abs(rate - 4 * e / (0.1 + 0.02 + 0.05)) < 1e-9
    # One row far behind with little left to decode: it would not gain, so it decodes plainly beside the others.
    assert plan_batch([2] * 4, alphas, costs, [0.0, 0.0, 0.0, 0.3]) == [2, 2, 2, 0]
    # Every row behind by as much: catching up costs more than drafting gains, the batch decodes plainly.
    assert plan_batch([2] * 4, alphas, costs, [0.3] * 4) == [0] * 4
    # A cheap catch-up is worth it.
    assert plan_batch([2] * 4, alphas, costs, [0.005] * 4) == [2] * 4


def test_batch_plan_drafts_the_rows_that_gain_beside_rows_that_decode_plainly() -> None:
    from tandem.core.batch_plan import plan_batch, predicted_rate

    # Forwards cost 0.1 s whatever the width; a draft step 0.01 s per row drafting.
    costs = CostModel(draft_step=0.01, verify={1: 0.1, 2: 0.1}, draft_rows={4: 0.04}, batched={(4, 1): 0.1},
                      frozen=True)
    # A session in fallback (k 0) decodes plainly in the same forward while the other three draft: the batch's
    # tokens per second is higher than with the whole batch plain.
    assert predicted_rate([2, 2, 2, 0], [0.8] * 4, costs) > predicted_rate([0] * 4, [0.8] * 4, costs)
    assert plan_batch([2, 2, 2, 0], [0.8] * 4, costs) == [2, 2, 2, 0]
    # A row that rarely agrees with the drafter: its two draft steps (0.02 s) bring 0.17 tokens, less than the 0.02 s
    # decode for the batch, so it drafts nothing; the others draft 2 (a better rate than all at cap 1).
    alphas = [0.9, 0.9, 0.9, 0.15]
    assert plan_batch([2] * 4, alphas, costs) == [2, 2, 2, 0]
    assert predicted_rate([2, 2, 2, 0], alphas, costs) > predicted_rate([2] * 4, alphas, costs)
    assert predicted_rate([2, 2, 2, 0], alphas, costs) > predicted_rate([1, 1, 1, 0], alphas, costs)
    # Where a draft step costs as much over one row as over four (memory-bound), its drafts come free beside its
    # mates: it drafts, although alone it would gain less than plain decoding.
    flat = CostModel(draft_step=0.01, verify={1: 0.1, 2: 0.1}, draft_rows={4: 0.01}, batched={(4, 1): 0.1},
                     frozen=True)
    assert plan_batch([2] * 4, alphas, flat) == [2] * 4
    assert predicted_rate([2] * 4, alphas, flat) > predicted_rate([2, 2, 2, 0], alphas, flat)
    # No row gains: the batch decodes plainly.
    assert plan_batch([2] * 4, [0.05] * 4, costs) == plan_batch([2] * 4, [0.05] * 4, flat) == [0] * 4


def test_batch_plan_prices_rows_of_different_widths_as_the_target_lays_them_out() -> None:
    from tandem.core.batch_plan import plan_batch, predicted_rate, round_seconds
    from tandem.core.row_layout import RowLayout

    def costs(layout: RowLayout | None) -> CostModel:
        # A CPU-like target: 4 rows cost 0.06 s plus 0.04 s per token of width; draft steps are cheap.
        return CostModel(draft_step=0.004, verify={n: 0.1 + 0.02 * (n - 1) for n in (1, 2, 3, 5, 8)},
                         draft_rows={4: 0.005}, batched={(4, w): 0.06 + 0.04 * w for w in (1, 2, 3, 5)}, frozen=True,
                         layout=layout)

    padded, packed = costs(RowLayout("cpu", can_pack=False)), costs(RowLayout("cpu", can_pack=True))
    # One row drafting 6 beside three decoding: padded, every row is 7 tokens wide; packed, the forward feeds the
    # 10 tokens alone, priced as 4 rows of 2.5.
    assert round_seconds([6, 0, 0, 0], padded) == pytest.approx(0.06 + 0.04 * 7 + 6 * 0.004)
    assert round_seconds([6, 0, 0, 0], packed) == pytest.approx(0.06 + 0.04 * 2.5 + 6 * 0.004)
    assert round_seconds([6, 0, 0, 0], costs(None)) == round_seconds([6, 0, 0, 0], padded)  # no layout: padded
    assert round_seconds([2] * 4, packed) == round_seconds([2] * 4, padded)  # like widths: nothing to pack
    # One row agrees with its drafter far more than its mates. Padded, a long block widens every row, so the plan
    # drafts one token a row; packed, the long block costs its own tokens only, and it goes to the row that gains.
    alphas = [0.95, 0.4, 0.4, 0.4]
    assert plan_batch([4] * 4, alphas, padded, limits=[6] * 4) == [1] * 4
    assert plan_batch([4] * 4, alphas, packed, limits=[6] * 4) == [6, 0, 0, 0]
    assert predicted_rate([6, 0, 0, 0], alphas, packed) > predicted_rate([1] * 4, alphas, packed)
    # On a GPU the same rows stay padded (narrow products stream the weights), so the plan is the padded one.
    assert plan_batch([4] * 4, alphas, costs(RowLayout("cuda", can_pack=True)), limits=[6] * 4) == [1] * 4
    # A compiled runner's forwards up to 16 wide run padded, one graph per width, whatever the rows' widths: the
    # plan prices them so (priced packed, it gave [6, 0, 0, 0], which then ran 7 tokens wide on every row).
    compiled = costs(RowLayout("cpu", can_pack=True, padded_up_to=16))
    assert round_seconds([6, 0, 0, 0], compiled) == round_seconds([6, 0, 0, 0], padded)
    assert plan_batch([4] * 4, alphas, compiled, limits=[6] * 4) == [1] * 4
    assert round_seconds([16, 0, 0, 0], compiled) == round_seconds([16, 0, 0, 0], packed)  # wider: eager, packed


def test_batch_plan_lets_rows_draft_past_their_sessions_k_within_their_limits() -> None:
    from tandem.core.batch_plan import plan_batch

    # Memory-bound: a forward costs the same over 64 tokens as over one, a draft step almost nothing.
    cheap = CostModel(draft_step=0.001, verify={1: 0.1, 64: 0.1001}, draft_rows={8: 0.001}, frozen=True)
    assert plan_batch([1, 1, 2, 1], [0.8] * 4, cheap, limits=[6, 6, 6, 6]) == [6] * 4
    # Each row within its own limit (a request's max_k, its tokens left); a session that does not draft stays at 0.
    assert plan_batch([1, 1, 2, 0], [0.8] * 4, cheap, limits=[6, 3, 6, 6]) == [6, 3, 6, 0]
    assert plan_batch([1, 1, 2, 1], [0.8] * 4, cheap) == [1, 1, 2, 1]  # no limits: the sessions' own k at most


def test_a_plans_prices_are_the_cost_models_own() -> None:
    """core.batch_plan.Prices, the view a plan prices through, gives each shape the model's own price (cached per
    shape, never one shape's price for another), reads everything else from the model, and is not wrapped twice."""
    from tandem.core.batch_plan import Prices, prices

    costs = CostModel(draft_step=0.03, verify={1: 0.1, 2: 0.12, 5: 0.2}, draft_rows={2: 0.04, 4: 0.05, 8: 0.09},
                      batched={(4, 1): 0.15, (4, 3): 0.25, (8, 1): 0.2, (8, 2): 0.3, (8, 5): 0.6})
    view = prices(costs)
    assert isinstance(view, Prices) and prices(view) is view
    for _ in range(2):  # computed, then cached
        for rows in range(1, 17):
            assert view.draft_time(rows) == costs.draft_time(rows)
            for width in range(1, 10):
                assert view.batch_forward_time(rows, width) == costs.batch_forward_time(rows, width)
    assert view.calibrated and view.layout is None and view.verify_time(3) == costs.verify_time(3)
    assert view.catch_up_time(40) == costs.catch_up_time(40)
