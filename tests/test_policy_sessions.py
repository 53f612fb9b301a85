"""A session's adaptive policy: k follows acceptance and costs; fallback engages, probes back off, and disengages;
deciding is a query and applying records it; its state round-trips through JSON and keeps the cached tokens new ones
repeat; and the deployment's shared prior is measured from its sessions' evidence, which fades with time."""

from __future__ import annotations

import itertools
import json

from policy_harness import _choose, _costs, _rounds
from tandem.core import policy
from tandem.core.config import SpecConfig
from tandem.core.costs import CostModel


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
