"""The cost model the policy prices rounds with: it interpolates and extrapolates, never prices a forward above a
wider one, follows a machine that speeds up or slows down without pricing drafting wrongly, keeps batched costs apart
from single-sequence ones (row counts timed in plain rounds, a compiled runner's buckets, one noisy timing), and adopts
every measured field."""

from __future__ import annotations

import json

import pytest

from policy_harness import _choose
from tandem.core import policy
from tandem.core.config import SpecConfig
from tandem.core.costs import CostModel


def test_cost_model_interpolates_and_extrapolates() -> None:
    costs = CostModel(verify={1: 1.0, 3: 1.4})
    assert abs(costs.verify_time(1) - 1.2) < 1e-12  # k=1 feeds 2 tokens: halfway between 1 and 3
    assert abs(costs.verify_time(4) - 1.8) < 1e-12
    costs.observe_verify(3, 2.4)
    assert abs(costs.verify[3] - (0.8 * 1.4 + 0.2 * 2.4)) < 1e-12
    assert abs(costs.verify[1] - 1.6 / 1.4) < 1e-12  # the other width follows: the machine slowed for both
    costs.observe_verify(1, 100.0)  # a stall moves the estimate by at most smoothing x its size
    assert abs(costs.verify[1] - 1.2 * 1.6 / 1.4) < 1e-12 and abs(costs.verify[3] - 1.2 * 1.6) < 1e-12


def test_calibrated_costs_never_price_a_forward_above_a_wider_one() -> None:
    from tandem.core.calibration import _cap_by_larger

    costs = CostModel(draft_step=0.08, verify={1: 0.2, 2: 0.13, 3: 0.15}, draft_rows={2: 0.06, 4: 0.07},
                      batched={(8, 1): 0.27, (8, 2): 0.21, (8, 3): 0.22, (2, 1): 0.2})
    _cap_by_larger(costs)  # timings only ever come out too slow: the wider shape's lower time is the better one
    assert costs.verify == {1: 0.13, 2: 0.13, 3: 0.15} and costs.draft_step == 0.06
    assert costs.batched == {(8, 1): 0.21, (8, 2): 0.21, (8, 3): 0.22, (2, 1): 0.2}


def test_a_machine_that_speeds_up_in_plain_rounds_does_not_price_drafting_dearer() -> None:
    # Plain rounds re-measure only the one-token forward; the wider ones follow it down, so their relative cost is
    # still the calibrated one. Had they kept the slower past (0.25 s next to 0.15), a session at acceptance 0.6 would
    # fall back to plain decoding, and its plain rounds would keep it there.
    costs = CostModel(draft_step=0.05, verify={1: 0.25, 2: 0.25, 3: 0.26, 5: 0.26},
                      batched={(8, 1): 0.3, (8, 2): 0.32, (2, 1): 0.26})
    for _ in range(30):
        costs.observe_verify(1, 0.15)
        costs.observe_verify(1, 0.18, rows=8)
    assert abs(costs.verify[1] - 0.15) < 0.005 and abs(costs.verify[3] / costs.verify[1] - 0.26 / 0.25) < 1e-9
    assert abs(costs.batched[8, 2] / costs.batched[8, 1] - 0.32 / 0.3) < 1e-9 and costs.batched[2, 1] == 0.26
    session = policy.PolicyState(accepted=3.0, rejected=2.0)
    stale = CostModel(draft_step=0.05, verify={1: costs.verify[1], 2: 0.25, 3: 0.26, 5: 0.26})
    assert policy.decide(session, stale, SpecConfig(), 0.9).fallback
    decision = policy.decide(session, costs, SpecConfig(), 0.9)
    assert decision.k > 0 and not decision.fallback


def test_batched_costs_are_kept_apart_from_single_sequence_costs() -> None:
    costs = CostModel(draft_step=0.05, verify={1: 0.1, 8: 0.15, 16: 0.2, 32: 0.3})
    costs.observe_verify(1, 0.3, rows=8)  # a plain round of 8 rows: slower than one 8-token sequence
    assert costs.verify[8] == 0.15 and costs.batched == {(8, 1): 0.3}
    assert costs.batch_forward_time(8, 1) == 0.3
    # An unmeasured width for 8 rows follows the single-sequence curve, scaled to the measured 8-row point.
    assert abs(costs.batch_forward_time(8, 2) - 0.3 * 0.2 / 0.15) < 1e-12
    # No 4-row measurement: the 8-row cost at that width, scaled along the single-sequence curve (8 vs 16 tokens).
    assert abs(costs.batch_forward_time(4, 2) - 0.3 * 0.2 / 0.15 * 0.15 / 0.2) < 1e-12
    costs.observe_verify(1, 0.12, rows=2)
    assert abs(costs.batch_forward_time(4, 1) - (0.12 + (0.3 - 0.12) * 2 / 6)) < 1e-12  # between 2 and 8 rows


def test_a_row_count_timed_only_in_plain_rounds_grows_with_width_as_its_neighbours_do() -> None:
    from tandem.core.batch_plan import plan_batch

    # Calibrated at 2, 4 and 8 rows (CPU-A-like: flat, then climbing); a batch down to 7 rows as requests finish is
    # then timed in plain rounds, at width 1 only. One sequence's curve climbs faster than a batch's (14 tokens at
    # 1.53x 7); priced along it, 7 rows x 2 tokens cost 0.24 s and the plan kept those rounds plain for good.
    batched = {(2, w): s for w, s in {1: 0.152, 2: 0.156, 3: 0.16, 5: 0.17}.items()}
    batched |= {(4, w): s for w, s in {1: 0.155, 2: 0.165, 3: 0.19, 5: 0.24}.items()}
    batched |= {(8, w): s for w, s in {1: 0.162, 2: 0.211, 3: 0.27, 5: 0.39}.items()}
    verify = {1: 0.15, 2: 0.152, 3: 0.155, 5: 0.16, 7: 0.17, 9: 0.18, 12: 0.22, 16: 0.30, 24: 0.36}
    costs = CostModel(draft_step=0.019, verify=verify, batched=batched,
                      draft_rows={2: 0.03, 4: 0.035, 8: 0.047})
    costs.observe_verify(1, 0.157, rows=7)
    assert costs.batch_forward_time(7, 1) == 0.157
    for width in (2, 3, 5):
        def between(w: int) -> float:
            four, eight = costs.batch_forward_time(4, w), costs.batch_forward_time(8, w)
            return four + (eight - four) * 3 / 4

        assert costs.batch_forward_time(7, width) == pytest.approx(0.157 * between(width) / between(1))
    assert costs.batch_forward_time(7, 2) < 0.2 < 0.157 * costs.forward_time(14) / costs.forward_time(7)
    assert plan_batch([3] * 7, [0.8] * 7, costs) == [1] * 7  # drafts, where the single-sequence curve gave [0] * 7
    # Past the widest row count timed at several widths: that one's growth.
    costs.observe_verify(1, 0.2, rows=12)
    assert costs.batch_forward_time(12, 3) == pytest.approx(0.2 * costs.batch_forward_time(8, 3) / 0.162)
    # With no row count timed at several widths, the single-sequence curve as before.
    lone = CostModel(draft_step=0.019, verify=verify, batched={(7, 1): 0.157})
    assert lone.batch_forward_time(7, 2) == pytest.approx(0.157 * lone.forward_time(14) / lone.forward_time(7))


def test_a_compiled_runners_batch_is_timed_and_priced_as_its_bucket() -> None:
    from tandem.core.batch_plan import plan_batch
    from tandem.core.row_layout import RowLayout

    # A compiled runner runs 5-8 rows as the 8-row graph: a batch down to 7 rows is timed into the 8-row table and
    # priced from it, calibrated at several widths, rather than from a table of its own begun by one plain round.
    layout = RowLayout("cpu", can_pack=True, padded_up_to=16, row_buckets=(1, 2, 4, 8, 16))
    batched = {(8, w): s for w, s in {1: 0.162, 2: 0.211, 3: 0.27, 5: 0.39}.items()}
    costs = CostModel(draft_step=0.019, verify={1: 0.15, 7: 0.17, 14: 0.26, 21: 0.33}, batched=dict(batched),
                      draft_rows={2: 0.03, 8: 0.047}, layout=layout)
    costs.observe_verify(1, 0.172, rows=7)
    assert {rows for rows, _ in costs.batched} == {8} and costs.batched[8, 1] == pytest.approx(0.164)
    assert costs.batched[8, 2] / costs.batched[8, 1] == pytest.approx(0.211 / 0.162)  # the widths move together
    for width in (1, 2, 3, 5):
        assert costs.batch_forward_time(7, width) == costs.batch_forward_time(5, width) == costs.batch_forward_time(
            8, width)
    assert plan_batch([3] * 7, [0.8] * 7, costs) == [1] * 7
    # Wider than the static forwards: eager, over the rows themselves.
    costs.observe_verify(20, 0.9, rows=7)
    assert costs.batched[7, 20] == 0.9 and layout.priced_rows(7, 20) == 7
    # Without buckets (an eager runner) every row count keeps its own table.
    eager = CostModel(draft_step=0.019, verify={1: 0.15}, batched=dict(batched), layout=RowLayout("cpu", True))
    eager.observe_verify(1, 0.172, rows=7)
    assert eager.batched[7, 1] == 0.172 and eager.batched[8, 1] == 0.162
    # The layout crosses the pool's wire in a worker's info (a JSON-like dict) and comes back whole; a worker that
    # reports none is priced padded, each row count as itself.
    assert RowLayout.from_info(json.loads(json.dumps(layout.to_info()))) == layout
    assert RowLayout.from_info({}) == RowLayout("cpu", can_pack=False)


def test_one_slow_or_fast_timing_moves_batched_prices_little() -> None:
    from tandem.core.batch_plan import plan_batch

    # 8 rows cost 0.15 s + 0.01 s per token of width; one width was timed in a fast moment, one in a slow spell
    # (as a table on the 2-core machine held 8 x 7 at 0.154 s and 8 x 9 at 0.318 s).
    batched = {(8, w): 0.15 + 0.01 * w for w in (1, 2, 3, 5, 6)} | {(8, 7): 0.12, (8, 9): 0.40}
    costs = CostModel(draft_step=0.05, verify={1: 0.15, 2: 0.16}, batched=batched, frozen=True,
                      draft_rows={2: 0.051, 3: 0.052, 4: 0.053, 6: 0.055, 8: 0.11})  # 8 rows: one slow timing
    for width in (1, 4, 7, 9):
        assert costs.batch_forward_time(8, width) == pytest.approx(0.15 + 0.01 * width, rel=0.02)
    assert costs.draft_time(8) == pytest.approx(0.057, rel=0.02)
    assert all(costs.batch_forward_time(8, w + 1) >= costs.batch_forward_time(8, w) for w in range(1, 12))
    # The plan is the one the noiseless timings give (priced point by point, the slow 8 x 9 and 8-row draft step
    # made every wide round look dearer than it is).
    clean = CostModel(draft_step=0.05, verify={1: 0.15, 2: 0.16}, frozen=True,
                      batched={(8, w): 0.15 + 0.01 * w for w in (1, 9)}, draft_rows={8: 0.057})
    assert plan_batch([8] * 8, [0.95] * 8, costs) == plan_batch([8] * 8, [0.95] * 8, clean) == [6] * 8


def test_a_batched_one_token_forward_is_priced_at_its_own_timing_not_below() -> None:
    # A batch's cost is flat at narrow widths (weights-bound) and then climbs: the line through the widths runs below
    # the one-token point, which plain rounds keep re-timing. Calibrated on CPU-A (at-once-v6.json, 8 rows).
    batched = {(8, 1): 0.1395, (8, 2): 0.1797, (8, 3): 0.2375, (8, 5): 0.3496}
    costs = CostModel(draft_step=0.05, verify={1: 0.1}, batched=batched, frozen=True)
    assert costs.batch_forward_time(8, 1) == 0.1395
    assert costs.batch_forward_time(8, 3) == pytest.approx(0.2375, rel=0.02)  # the line, where it fits
    assert all(costs.batch_forward_time(8, w + 1) >= costs.batch_forward_time(8, w) for w in range(1, 12))


def test_a_slower_narrow_forward_raises_the_price_of_wider_ones() -> None:
    # Calibrated at a short context; plain rounds then re-measure only the one-token forward as the context grows.
    costs = CostModel(draft_step=0.01, verify={1: 0.10, 2: 0.11, 3: 0.12}, batched={(4, 1): 0.2, (4, 2): 0.21})
    for _ in range(20):
        costs.observe_verify(1, 0.2)
        costs.observe_verify(1, 0.4, rows=4)
    assert abs(costs.verify[1] - 0.2) < 0.01 and abs(costs.verify[3] / costs.verify[1] - 1.2) < 1e-9
    assert costs.verify_time(2) > costs.verify_time(1) > costs.verify_time(0)
    assert costs.batch_forward_time(4, 2) > costs.batch_forward_time(4, 1) > 0.39
    # So a probe that drafted and accepted nothing can never look faster than plain decoding.
    config = SpecConfig(probe_interval=2)
    state = policy.PolicyState(fallback=True, probe_interval=2)
    for _ in range(20):
        policy.update(state, k := _choose(state, costs, config), 0, costs, config)
        assert state.fallback, k


def test_adopting_measured_costs_takes_every_measured_field() -> None:
    from dataclasses import fields

    from tandem.core.costs import MEASURED_FIELDS
    from tandem.core.row_layout import RowLayout

    assert set(MEASURED_FIELDS) == {f.name for f in fields(CostModel)} - {"smoothing", "frozen", "layout"}
    measured = CostModel(draft_step=0.1, verify={1: 0.2}, draft_rows={2: 0.15}, batched={(2, 1): 0.3},
                         draft_forward={4: 0.2})
    layout = RowLayout("cpu", can_pack=True)
    costs = CostModel(smoothing=0.5, frozen=True, layout=layout)
    costs.adopt(measured)
    assert costs.to_dict() == measured.to_dict() and costs.smoothing == 0.5 and costs.frozen
    assert costs.layout is layout  # the target's, not a measurement
