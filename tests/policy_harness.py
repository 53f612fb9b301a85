"""What the policy's test modules (tests/test_policy_sessions.py, tests/test_policy_costs.py) share: static costs
like the tiny pair's, and rounds driven through the policy as the engine drives them."""

from __future__ import annotations

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
