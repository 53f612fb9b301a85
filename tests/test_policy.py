"""The adaptive policy: k follows acceptance and costs; fallback engages, probes back off, and disengages."""

from __future__ import annotations

import itertools
import json

from tandem.core import policy
from tandem.core.config import SpecConfig
from tandem.core.costs import CostModel


def _costs(draft_step: float = 0.3) -> CostModel:
    return CostModel(draft_step=draft_step, verify={n: 1.0 + 0.05 * (n - 1) for n in range(1, 10)}, frozen=True)


def _rounds(state: policy.PolicyState, costs: CostModel, config: SpecConfig, accept_all: bool, n: int) -> list[int]:
    ks = []
    for _ in range(n):
        k = policy.choose_k(state, costs, config)
        ks.append(k)
        policy.update(state, k, k if accept_all else 0, costs, config)
    return ks


def test_k_grows_with_acceptance_and_shrinks_with_draft_cost() -> None:
    config, costs = SpecConfig(k_max=8), _costs()
    assert policy.best_k(0.9, costs, 8)[0] > policy.best_k(0.5, costs, 8)[0]
    assert policy.best_k(0.8, _costs(0.5), 8)[0] < policy.best_k(0.8, costs, 8)[0]
    assert policy.expected_tokens(0.0, 4) == 1.0
    assert abs(policy.expected_tokens(0.5, 2) - 1.75) < 1e-12
    assert policy.choose_k(policy.PolicyState(), CostModel(), config) == config.k_init  # uncalibrated


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


def test_hysteresis_keeps_marginal_sessions_in_place() -> None:
    config = SpecConfig(enter_fallback_margin=0.1, exit_fallback_margin=0.1)
    costs = _costs(draft_step=0.02)
    alpha = 0.05  # speculative rate within a few percent of plain: neither enter nor leave
    _, rate = policy.best_k(alpha, costs, config.k_max)
    assert 0.9 < rate * costs.verify_time(0) < 1.1
    on = policy.PolicyState(accepted=alpha * 1000, rejected=(1 - alpha) * 1000)
    policy.choose_k(on, costs, config)
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
    costs.observe_verify(1, 100.0)  # a stall moves the estimate by at most smoothing x its size
    assert abs(costs.verify[1] - 1.2) < 1e-12


def test_batch_arms_follow_measured_goodput_and_keep_exploring() -> None:
    from tandem.core.batch_arms import PLAIN, SPECULATE, BatchArms

    arms = BatchArms(explore_every=8)
    assert arms.choose(1) == SPECULATE  # a single sequence is left to its own policy
    chosen = []
    for _ in range(64):
        arm = arms.choose(8)
        chosen.append(arm)
        arms.observe(8, arm, tokens=8 if arm == PLAIN else 12, seconds=0.3 if arm == PLAIN else 1.2)
    assert chosen[:2] == [SPECULATE, PLAIN]  # each measured once first
    later = chosen[16:]
    assert later.count(PLAIN) > 0.8 * len(later) and SPECULATE in later  # plain wins here, speculation re-tested
    arms.observe(4, SPECULATE, tokens=20, seconds=0.5)
    arms.observe(4, PLAIN, tokens=4, seconds=0.4)
    assert arms.choose(4) == SPECULATE  # each batch size has its own measurements
