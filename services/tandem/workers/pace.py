"""How fast a pool's workers get through the tokens of a call, learned from the calls they answer.

A pool call's deadline is a base plus an allowance per token the call carries (a prompt to prefill, a history to
resend): a slow worker on a long prompt is slow, not hung. The allowance is sized for the slowest machine measured
(the pools' PER_TOKEN_S: the 1.5B target's bf16 prefill on one AVX2 core took 0.34 s a token), so on a GPU, where a
prefill takes well under a millisecond a token, a hung draft worker sent a 2000-token prompt held that round, and
every session of the engine with it, for 5 minutes (5 s + 0.15 s x 2000) before it was benched. Once the pool has
answered calls long enough to show its pace, a call gets `MARGIN` times that pace per token instead, never more than
the fixed allowance.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MARGIN = 4.0  # a call may take this many times the pool's recent pace before it counts as hung
MIN_TOKENS = 16  # calls carrying fewer tokens are mostly fixed costs (draft steps, one forward's overhead)
DECAY = 0.98  # per call taught: one stall (a first call setting up its kernels) does not stand for good


@dataclass(slots=True)
class Pace:
    """Seconds per token, the slowest a worker of the pool took recently over a call's share of tokens (0: nothing
    learned yet). `count`: the tokens one request carries, as the pool prices its deadline."""

    count: Callable[[Any], int]
    per_token: float = 0.0

    def observe(self, seconds: float, requests: list) -> None:
        """A worker answered `requests` (its share of a call) `seconds` after the call went out: an overestimate of
        its own time where it waited behind other workers' replies, which errs on the side of a longer deadline."""
        tokens = sum(self.count(r) for r in requests)
        if tokens >= MIN_TOKENS:
            self.per_token = max(seconds / tokens, self.per_token * DECAY)

    def allowance(self, ceiling: float) -> float:
        """Seconds a call may take per token: MARGIN times the pace, at most `ceiling` (the pool's fixed allowance),
        and `ceiling` until a pace is learned."""
        return min(ceiling, MARGIN * self.per_token) if self.per_token else ceiling
