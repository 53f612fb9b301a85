"""The adaptive policy: k follows acceptance and costs; fallback engages, probes back off, and disengages."""

from __future__ import annotations

import itertools
import json

import pytest

from tandem.core import policy
from tandem.core.config import SpecConfig
from tandem.core.costs import CostModel


def _costs(draft_step: float = 0.3) -> CostModel:
    return CostModel(draft_step=draft_step, verify={n: 1.0 + 0.05 * (n - 1) for n in range(1, 10)}, frozen=True)


def _choose(state: policy.PolicyState, costs: CostModel, config: SpecConfig) -> int:
    """One round's k, its decision applied as the engine applies it to a round that runs."""
    decision = policy.decide(state, costs, config)
    policy.apply(state, decision)
    return decision.k


def _rounds(state: policy.PolicyState, costs: CostModel, config: SpecConfig, accept_all: bool, n: int) -> list[int]:
    ks = []
    for _ in range(n):
        k = _choose(state, costs, config)
        ks.append(k)
        policy.update(state, k, k if accept_all else 0, costs, config)
    return ks


def test_k_grows_with_acceptance_and_shrinks_with_draft_cost() -> None:
    config, costs = SpecConfig(k_max=8), _costs()
    assert policy.best_k(0.9, costs, 8)[0] > policy.best_k(0.5, costs, 8)[0]
    assert policy.best_k(0.8, _costs(0.5), 8)[0] < policy.best_k(0.8, costs, 8)[0]
    assert policy.expected_tokens(0.0, 4) == 1.0
    assert abs(policy.expected_tokens(0.5, 2) - 1.75) < 1e-12
    assert policy.decide(policy.PolicyState(), CostModel(), config).k == config.k_init  # uncalibrated


def test_fallback_engages_on_rejection_and_probes_back_off() -> None:
    config, costs = SpecConfig(probe_interval=4, probe_interval_max=16), _costs()
    state = policy.PolicyState(k=config.k_init)
    ks = _rounds(state, costs, config, accept_all=False, n=60)
    assert state.fallback
    first_zero = ks.index(0)
    assert first_zero <= 3, f"fallback should engage within a few rounds, ks={ks[:8]}"
    probes = [i for i, k in enumerate(ks) if k > 0 and i > first_zero]
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert gaps == sorted(gaps) and gaps[-1] == 16, f"probe gaps should double up to the cap: {gaps}"


def test_fallback_disengages_when_draft_agrees_again() -> None:
    config, costs = SpecConfig(probe_interval=4), _costs()
    state = policy.PolicyState(k=config.k_init)
    _rounds(state, costs, config, accept_all=False, n=20)
    assert state.fallback
    ks = _rounds(state, costs, config, accept_all=True, n=40)
    assert not state.fallback
    assert all(k > 0 for k in ks[-10:])


def test_no_probe_runs_where_no_probe_could_leave_fallback() -> None:
    """Verifying k drafts costs k + 1 plain steps (bf16 on a CPU without fast bf16 units): even drafts that all pass
    cannot beat plain decoding, so fallback skips its probes, backing off as if they had failed; once the measured
    costs make speculation pay again, the next due probe runs and finds it."""
    config = SpecConfig(probe_interval=4, probe_interval_max=16)
    linear = CostModel(draft_step=0.1, verify={n: float(n) for n in range(1, 10)}, frozen=True)
    assert not policy.probe_can_exit(linear, config) and policy.probe_can_exit(_costs(), config)
    state = policy.PolicyState(k=config.k_init)
    assert _rounds(state, linear, config, accept_all=True, n=200) == [0] * 200
    assert state.fallback and state.probe_interval == 16 and state.accepted == 0.0
    linear.adopt(_costs())
    ks = _rounds(state, linear, config, accept_all=True, n=40)
    assert 0 < ks.index(next(k for k in ks if k > 0)) <= 16 and not state.fallback


def test_deciding_is_a_query_and_applying_records_the_decision() -> None:
    """decide() reads the state only: asked twice (a round planned again after its batch shrank), it answers the
    same and moves no probe; apply() then records exactly what it decided."""
    config, costs = SpecConfig(probe_interval=4), _costs()
    for state in (policy.PolicyState(k=4),  # speculating
                  policy.PolicyState(rejected=50.0, k=4),  # about to enter fallback
                  policy.PolicyState(rejected=50.0, fallback=True, rounds_since_probe=1, probe_interval=4),  # waits
                  policy.PolicyState(rejected=50.0, fallback=True, rounds_since_probe=3, probe_interval=4)):  # probes
        before = state.to_dict()
        first, second = policy.decide(state, costs, config), policy.decide(state, costs, config)
        assert first == second and state.to_dict() == before
        policy.apply(state, first)
        assert (state.k, state.fallback, state.rounds_since_probe, state.probe_interval, state.probing) == (
            first.k, first.fallback, first.rounds_since_probe, first.probe_interval, first.probing)
        assert (state.accepted, state.rejected) == (before["accepted"], before["rejected"])
    entering = policy.decide(policy.PolicyState(rejected=50.0, k=4), costs, config)
    assert entering.fallback and entering.k == 0 and entering.probe_interval == 4 and entering.rounds_since_probe == 1
    probe = policy.decide(policy.PolicyState(rejected=50.0, fallback=True, rounds_since_probe=3, probe_interval=4),
                          costs, config)
    assert probe.probing and probe.k >= config.k_init and probe.rounds_since_probe == 0


def test_hysteresis_keeps_marginal_sessions_in_place() -> None:
    config = SpecConfig(enter_fallback_margin=0.1, exit_fallback_margin=0.1)
    costs = _costs(draft_step=0.02)
    alpha = 0.05  # speculative rate within a few percent of plain: neither enter nor leave
    _, rate = policy.best_k(alpha, costs, config.k_max)
    assert 0.9 < rate * costs.verify_time(0) < 1.1
    on = policy.PolicyState(accepted=alpha * 1000, rejected=(1 - alpha) * 1000)
    _choose(on, costs, config)
    assert not on.fallback


def test_state_round_trips_through_json() -> None:
    state = policy.PolicyState(accepted=3.5, rejected=1.25, k=3, fallback=True, rounds_since_probe=2, probe_interval=8)
    assert policy.PolicyState.from_dict(json.loads(json.dumps(state.to_dict()))) == state


def test_cost_model_interpolates_and_extrapolates() -> None:
    costs = CostModel(verify={1: 1.0, 3: 1.4})
    assert abs(costs.verify_time(1) - 1.2) < 1e-12  # k=1 feeds 2 tokens: halfway between 1 and 3
    assert abs(costs.verify_time(4) - 1.8) < 1e-12
    costs.observe_verify(3, 2.4)
    assert abs(costs.verify[3] - (0.8 * 1.4 + 0.2 * 2.4)) < 1e-12
    assert abs(costs.verify[1] - 1.6 / 1.4) < 1e-12  # the other width follows: the machine slowed for both
    costs.observe_verify(1, 100.0)  # a stall moves the estimate by at most smoothing x its size
    assert abs(costs.verify[1] - 1.2 * 1.6 / 1.4) < 1e-12 and abs(costs.verify[3] - 1.2 * 1.6) < 1e-12


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


def test_sync_keeps_the_cached_tokens_that_the_new_tokens_repeat() -> None:
    from tandem.core.sequence import SequenceState

    state = SequenceState(tokens=[1, 2, 3, 4, 5, 6], cached=6)  # an empty cache: only the bookkeeping counts
    state.sync(0, [1, 2, 3, 9])
    assert state.tokens == [1, 2, 3, 9] and state.cached == 3
    state.sync(4, [7])
    assert state.tokens == [1, 2, 3, 9, 7] and state.cached == 3
    state.cached = 5
    state.sync(2, [3, 9, 7, 8])
    assert state.tokens == [1, 2, 3, 9, 7, 8] and state.cached == 5


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


def test_the_shared_prior_is_measured_once_its_sessions_evidence_outweighs_its_guess() -> None:
    prior = policy.SharedPrior(initial=0.75, clock=lambda: 100.0)
    assert not prior.measured and prior.value == 0.75
    prior.observe(2, 2)  # two drafts accepted: two trials
    assert not prior.measured
    prior.observe(4, 2)  # two accepted, then a rejection: three more, the earlier ones decayed
    assert prior.measured and abs(prior.value - (0.99 * 2 + 2 + 0.75 * 4) / (0.99 * 2 + 3 + 4)) < 1e-12


def test_evidence_no_round_renews_fades_back_to_the_guess() -> None:
    """A batch that stopped drafting because the measured prior said drafting would not pay observes nothing more;
    with time its evidence fades (half-life), the prior is no longer measured, and new rows explore again."""
    now = [0.0]
    prior = policy.SharedPrior(initial=0.75, half_life=300.0, clock=lambda: now[0])
    for _ in range(20):
        prior.observe(4, 1)  # acceptance 0.5 of what was tried: well below the guess
    measured_value = prior.value
    assert prior.measured and measured_value < 0.6
    now[0] = 300.0  # one half-life: half the evidence, the estimate halfway nearer the guess in weight
    assert prior.measured and measured_value < prior.value < 0.75
    now[0] = 3000.0  # ten half-lives: the evidence weighs less than the guess's pseudo-trials
    assert not prior.measured and abs(prior.value - 0.75) < 0.01
    prior.observe(4, 4)  # a new round renews it from the faded evidence, not from the old
    assert prior.at == 3000.0 and prior.trials < 5.0
