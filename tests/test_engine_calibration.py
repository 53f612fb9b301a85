"""The engine's calibration: it times real batches and leaves no state, records batches as the rows the target
computes, is skipped by a fixed-k engine, and its measured costs put an unrelated draft into fallback."""

from __future__ import annotations

from engine_harness import PROMPT, _greedy
from tandem.core.config import EngineConfig, SpecConfig
from tandem.core.costs import CostModel
from tandem.engines.local import build_engine


def test_calibration_times_real_batches_and_leaves_no_state(tiny_models) -> None:
    target, draft, _ = tiny_models
    engine = build_engine(target, draft, EngineConfig(spec=SpecConfig(k_max=3, k_init=2), max_batch=4))
    costs = engine.costs
    assert set(costs.verify) >= {1, 2, 3, 4} and costs.draft_step > 0
    assert set(costs.batched) == {(rows, width) for rows in (2, 4) for width in (1, 2, 3)}
    assert set(costs.draft_rows) == {2, 4} and all(seconds > 0 for seconds in costs.batched.values())
    assert set(costs.draft_forward) == {4, 8, 16, 32} and costs.draft_forward[4] <= costs.draft_forward[32]
    assert not engine.verifier.runner.states and not engine.drafter.runner.states


def test_calibration_records_batches_as_the_rows_the_target_computes(tiny_models) -> None:
    """Under a layout whose static forwards run 6 rows as 8 (a compiled runner's row buckets), calibration at
    --max-batch 6 records its widest batches as 8 rows, as the batch plan prices them; so no batch of up to 6 rows is
    priced from single-sequence forwards wider than k_max + 1, which calibration no longer times."""
    from tandem.core.calibration import calibrate
    from tandem.core.row_layout import RowLayout

    target, draft, _ = tiny_models
    engine = build_engine(target, draft, EngineConfig(spec=SpecConfig(k_max=3, k_init=2), calibrate=False))
    engine.verifier.row_layout = RowLayout("cpu", can_pack=False, padded_up_to=16, row_buckets=(1, 2, 4, 8))
    costs = calibrate(engine.verifier, engine.drafter, k_max=3, k_init=2, max_batch=6)
    assert {rows for rows, _ in costs.batched} == {2, 4, 8} and set(costs.verify) == {1, 2, 3, 4}
    with_wide = CostModel(**{name: getattr(costs, name) for name in ("draft_step", "draft_rows", "batched")},
                          verify=costs.verify | {n: 100.0 * n for n in (8, 12, 16, 24, 32)}, layout=costs.layout)
    for rows in range(1, 7):
        for width in range(1, 5):
            assert costs.batch_forward_time(rows, width) == with_wide.batch_forward_time(rows, width)
    assert not engine.verifier.runner.states and not engine.drafter.runner.states


def test_a_fixed_k_engine_starts_without_calibrating(tiny_models) -> None:
    target, draft, _ = tiny_models
    engine = build_engine(target, draft, EngineConfig(spec=SpecConfig(k_max=3, k_init=3, adaptive=False)))
    assert not engine.costs.calibrated
    result = engine.generate([PROMPT], _greedy(max_tokens=12))[0]
    assert result.stats["drafted"] > 0 and not result.stats["fallback"]


def test_measured_costs_put_random_draft_into_fallback(tiny_models) -> None:
    target, _, draft_random = tiny_models
    engine = build_engine(target, draft_random)
    assert engine.costs.calibrated
    result = engine.generate([PROMPT], _greedy(max_tokens=200))[0]
    assert result.stats["fallback"] and result.stats["fallback_rounds"] > result.stats["rounds"] // 2
