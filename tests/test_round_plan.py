"""The round plan: every rule that bounds a row's k, each on its own, with calibrated costs and no models."""

from __future__ import annotations

import dataclasses

from tandem.core import policy
from tandem.core.config import SpecConfig
from tandem.core.costs import CostModel
from tandem.core.round_plan import RowView, plan_round

SPEC = SpecConfig()
PRIOR = 0.6
# Batched drafting always pays: target forwards cost the same whatever their width, draft steps are cheap.
CHEAP = CostModel(draft_step=0.01, verify={n: 1.0 for n in range(1, 12)}, draft_rows={2: 0.01},
                  batched={(2, w): 1.0 for w in range(1, 12)}, frozen=True)
# A forward costs 0.1 s + 0.02 s per token fed: one session drafts, but a batch of 8 gains nothing from drafting.
COMPUTE_BOUND = CostModel(draft_step=0.03, verify={n: 0.1 + 0.02 * n for n in (1, 2, 64)}, draft_rows={8: 0.1},
                          frozen=True)


def _row(**changes) -> RowView:
    row = RowView(policy.PolicyState(k=SPEC.k_init), max_k=None, remaining=100, prefill_limit=0, first_round=False,
                  behind=1)
    return dataclasses.replace(row, **changes)


def _plan(rows: list[RowView], costs: CostModel = CHEAP, spec: SpecConfig = SPEC, speculating: bool = True):
    return plan_round(rows, speculating, spec, costs, PRIOR)


def _policy_k(costs: CostModel = CHEAP, spec: SpecConfig = SPEC) -> int:
    return policy.decide(policy.PolicyState(k=spec.k_init), costs, spec, PRIOR).k


def test_a_lone_row_drafts_what_its_policy_decides() -> None:
    row = _row()
    plan = _plan([row])
    assert plan.ks == (_policy_k(),) and _policy_k() > 0
    assert plan.decisions == (policy.decide(row.policy, CHEAP, SPEC, PRIOR),)


def test_rows_that_may_not_draft_get_zero_and_leave_their_policy_unasked() -> None:
    assert _plan([_row()], speculating=False).ks == (0,)  # no drafter, or speculation off
    for row in (_row(max_k=0), _row(prefill_limit=64), _row(first_round=True)):
        plan = _plan([row])
        assert plan.ks == (0,) and plan.decisions == (None,), row


def test_the_first_round_drafts_without_plain_first_round_or_with_a_fixed_k() -> None:
    assert _plan([_row(first_round=True)], spec=SpecConfig(plain_first_round=False)).ks == (_policy_k(),)
    fixed = SpecConfig(adaptive=False, k_init=3)
    assert _plan([_row(first_round=True)], spec=fixed).ks == (3,)


def test_the_request_cap_and_the_tokens_left_bound_the_policys_k() -> None:
    assert _plan([_row(max_k=1)]).ks == (1,)
    assert _plan([_row(remaining=3)]).ks == (2,)  # the round's last token is the verifier's
    last = _plan([_row(remaining=1)])
    assert last.ks == (0,) and last.decisions[0] is not None  # the policy was asked: its probe clock moves
    assert last.decisions[0].k == _policy_k()  # the policy's own k, not the capped one


def test_a_batched_row_far_behind_in_its_drafter_catches_up_in_chunks_before_drafting() -> None:
    # Two tokens behind or fewer cost no catch-up of their own (they go with the first draft step).
    limit = SpecConfig(batch_catch_up_limit=2)
    gated = _plan([_row(behind=3), _row(behind=2)], spec=limit)
    assert gated.ks[0] == 0 and gated.ks[1] > 0
    assert gated.catch_up == (2, 0)  # the far row's drafter takes the next two tokens of its backlog
    assert all(_plan([_row(behind=2), _row(behind=2)], spec=limit).ks)
    alone = _plan([_row(behind=3)], spec=limit)
    assert alone.ks == (_policy_k(spec=limit),) and alone.catch_up == (0,)  # alone: it catches up and drafts
    fixed = SpecConfig(adaptive=False, k_init=3, batch_catch_up_limit=2)
    assert _plan([_row(behind=3), _row(behind=2)], spec=fixed).ks == (3, 3)  # a fixed k drafts as given
    # A row whose policy would not draft (speculation off, fallback, the first round) catches nothing up.
    resting = [_row(behind=40, first_round=True), _row(behind=40, max_k=0), _row(behind=40)]
    assert _plan(resting, speculating=False).catch_up == (0, 0, 0)
    assert _plan(resting).catch_up == (0, 0, SPEC.batch_catch_up_limit)
    # Where the batch would not draft once caught up, no catch-up is spent.
    assert _plan([_row(behind=40) for _ in range(8)], costs=COMPUTE_BOUND).catch_up == (0,) * 8
    assert _plan([_row(behind=40) for _ in range(8)]).catch_up == (SPEC.batch_catch_up_limit,) * 8


def test_a_row_that_rests_while_a_mate_drafts_rides_its_first_draft_step() -> None:
    # A row at k 0 whose policy was asked (a session in fallback) sends its drafter the token or two it lacks;
    # further behind, never drafting (max_k 0), or on its last token, it does not; nor does anyone where no row
    # drafts.
    resting = policy.PolicyState(rejected=40.0, fallback=True, probe_interval=16)  # no probe due: k 0
    rows = [_row(), _row(policy=resting, behind=2), _row(policy=resting, behind=3), _row(max_k=0, behind=1),
            _row(remaining=1, behind=1)]
    plan = _plan(rows)
    assert plan.ks[0] > 0 and plan.ks[1:] == (0, 0, 0, 0)
    assert plan.catch_up == (0, 2, 0, 0, 0)
    assert _plan([_row() for _ in range(8)], costs=COMPUTE_BOUND).catch_up == (0,) * 8


def test_the_batch_plan_prices_the_batched_round() -> None:
    alone = _plan([_row()], costs=COMPUTE_BOUND)
    assert alone.ks[0] > 0
    batch = _plan([_row() for _ in range(8)], costs=COMPUTE_BOUND)
    assert batch.ks == (0,) * 8  # eight rows: drafting costs more than it gains
    assert batch.decisions == alone.decisions * 8  # each session's policy was still asked


def test_batched_rows_draft_up_to_k_max_within_their_request_caps() -> None:
    # Where draft steps and padding cost next to nothing, every drafting row drafts the most it may, past its
    # policy's own k: k_max, its request's max_k, the tokens it has left less the verifier's own.
    lone = policy.PolicyState(k=1, accepted=2.0, rejected=2.0)  # a middling session: alone it drafts little
    assert 0 < _plan([_row(policy=lone)]).ks[0] < SPEC.k_max
    sure = policy.PolicyState(k=SPEC.k_max, accepted=200.0, rejected=2.0)
    rows = [_row(policy=lone), _row(policy=sure), _row(policy=sure, max_k=3), _row(policy=sure, remaining=3),
            _row(max_k=0)]
    assert _plan(rows).ks == (SPEC.k_max, SPEC.k_max, 3, 2, 0)


def test_planning_changes_nothing_and_repeats_itself() -> None:
    rows = [_row(policy=policy.PolicyState(rejected=40.0, fallback=True, rounds_since_probe=15, probe_interval=16)),
            _row(policy=policy.PolicyState(rejected=40.0, k=4)), _row(behind=3)]
    before = [row.policy.to_dict() for row in rows]
    first = _plan(rows, costs=COMPUTE_BOUND)
    assert _plan(rows, costs=COMPUTE_BOUND) == first and [row.policy.to_dict() for row in rows] == before
    assert first.decisions[0].probing and first.decisions[1].fallback  # a probe is due; a session enters fallback


def test_a_row_only_explored_pays_its_whole_catch_up_in_the_round_that_explores_it() -> None:
    # Forwards cost 0.1 s whatever their width, a draft step over the batch 0.03 s, a catch-up 0.01 s per token:
    # 0.16 s for a row 17 tokens behind. At the prior's acceptance (0.6) drafting does not pay; a new row is priced
    # optimistically so that it gets measured, and may never draft again after that round, so the round pays its
    # whole catch-up. A measured row spreads it over the rounds it has left (0.01 s a round).
    costs = CostModel(draft_step=0.01, verify={1: 0.1, 2: 0.1}, draft_rows={4: 0.03}, batched={(4, 1): 0.1},
                      draft_forward={8: 0.08, 32: 0.32}, frozen=True)
    sure = policy.PolicyState(k=SPEC.k_init, accepted=150.0, rejected=10.0)
    new = policy.PolicyState(k=SPEC.k_init)
    assert policy.optimistic_acceptance(new, SPEC, PRIOR) >= policy.acceptance(sure, SPEC, PRIOR)
    assert all(_plan([_row(policy=sure, behind=17) for _ in range(4)], costs=costs).ks)
    assert _plan([_row(policy=new, behind=17) for _ in range(4)], costs=costs).ks == (0,) * 4
    # Caught up, the same new rows are explored: their drafts then cost only the draft steps.
    assert all(_plan([_row(policy=new, behind=1) for _ in range(4)], costs=costs).ks)
    # Where drafting pays at the acceptance a new row is expected to have, its catch-up is an investment the rounds
    # it has left repay: spread, as for a measured row.
    cheap_steps = dataclasses.replace(costs, draft_rows={4: 0.01})
    assert all(_plan([_row(policy=new, behind=17) for _ in range(4)], costs=cheap_steps).ks)
    # While the deployment has measured no acceptance of its own (the prior is only the configured guess), new rows
    # are explored with their catch-ups spread: else a batch-only deployment would never learn it.
    unmeasured = plan_round([_row(policy=new, behind=17) for _ in range(4)], True, SPEC, costs, PRIOR,
                            prior_measured=False)
    assert all(unmeasured.ks)
