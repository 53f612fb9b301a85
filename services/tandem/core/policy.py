"""Per-session adaptive speculation: pick k to maximise expected tokens per second, fall back when it won't pay.

With per-token acceptance a, a round that drafts k tokens yields E(k) = (1 - a^(k+1)) / (1 - a) tokens and costs
k * T_draft + T_verify(k); plain decoding yields one token per T_verify(0). The session drops to plain decoding
when the best k is predicted slower than plain, probes now and then (backing off exponentially) to notice when
the draft starts agreeing again, and leaves fallback only past a higher bar (hysteresis). Where the costs leave no
probe a way past that bar (verifying k drafts costs about k + 1 plain steps, as on a CPU without fast bf16 matrix
units), it skips the probes: each one would pay a drafter catch-up and a wide verify for nothing.

A round asks `decide` (a pure query: the k and the fallback bookkeeping it implies), then, once the round has run,
records that decision with `apply` and its outcome with `update`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from tandem.core.config import SpecConfig
from tandem.core.costs import CostModel


@dataclass(slots=True)
class PolicyState:
    """Everything the policy remembers about one session; small and JSON-serialisable."""

    accepted: float = 0.0
    rejected: float = 0.0
    k: int = 0
    fallback: bool = False
    rounds_since_probe: int = 0
    probe_interval: int = 0
    probing: bool = False

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> PolicyState:
        return cls(**{name: data[name] for name in cls.__slots__ if name in data})


@dataclass(slots=True)
class SharedPrior:
    """Per-token acceptance across all recent sessions: where a new session's estimate starts.

    A round that accepts a of k drafts is a successes then one failure (or none if a == k). Evidence decays with
    each round (`decay`), so the prior follows a change of traffic or draft model, and with time (`half_life`
    seconds), so evidence that no round renews fades back to the guess: a batch that stopped drafting because the
    prior said it would not pay (core.round_plan) explores again once the prior is no longer measured.
    """

    initial: float
    weight: float = 4.0
    decay: float = 0.99
    half_life: float = 300.0
    accepted: float = 0.0
    trials: float = 0.0
    clock: Callable[[], float] = time.monotonic
    at: float = -1.0  # when accepted and trials were last brought up to date (clock's time); -1: at creation

    def __post_init__(self) -> None:
        if self.at < 0:
            self.at = self.clock()

    def _fade(self) -> float:
        return 0.5 ** (max(self.clock() - self.at, 0.0) / self.half_life)

    def observe(self, k: int, accepted: int) -> None:
        fade = self.decay * self._fade()
        self.at = self.clock()
        self.accepted = fade * self.accepted + accepted
        self.trials = fade * self.trials + accepted + (1 if accepted < k else 0)

    @property
    def measured(self) -> bool:
        """Whether the sessions' own evidence outweighs the initial guess's pseudo-trials."""
        return self.trials * self._fade() >= self.weight

    @property
    def value(self) -> float:
        fade = self._fade()
        estimate = (fade * self.accepted + self.initial * self.weight) / (fade * self.trials + self.weight)
        return min(max(estimate, 0.01), 0.99)


def acceptance(state: PolicyState, config: SpecConfig, prior: float | None = None) -> float:
    """The session's acceptance estimate: its own decayed evidence plus `prior_weight` pseudo-trials at the prior
    (the deployment's recent acceptance when given, else `acceptance_prior`)."""
    prior_accepted = (config.acceptance_prior if prior is None else prior) * config.prior_weight
    return (state.accepted + prior_accepted) / (state.accepted + state.rejected + config.prior_weight)


def measured(state: PolicyState) -> bool:
    """Whether the session has evidence of its own: it has drafted at least once."""
    return state.accepted + state.rejected > 0.0


def optimistic_acceptance(state: PolicyState, config: SpecConfig, prior: float | None = None) -> float:
    """The session's acceptance raised by the spread of its estimate (a Beta posterior's standard deviation) while
    the session has little evidence of its own, for the batch plan. Priced at the prior alone, a batch where the
    prior makes drafting a loss drafts nothing, so no row ever measures its real acceptance. The raise shrinks as
    the session's own evidence outweighs the prior (by their ratio), so a measured session is priced as measured."""
    mean = acceptance(state, config, prior)
    trials = state.accepted + state.rejected + config.prior_weight
    spread = (mean * (1.0 - mean) / (trials + 1.0)) ** 0.5
    return min(mean + spread * config.prior_weight / trials, 0.99)


def expected_tokens(alpha: float, k: int) -> float:
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def tokens_per_second(alpha: float, k: int, costs: CostModel) -> float:
    return expected_tokens(alpha, k) / costs.round_time(k)


def best_k(alpha: float, costs: CostModel, k_max: int) -> tuple[int, float]:
    rates = [(tokens_per_second(alpha, k, costs), k) for k in range(1, k_max + 1)]
    rate, k = max(rates)
    return k, rate


def passes_exit_bar(alpha: float, costs: CostModel, config: SpecConfig) -> bool:
    """Whether speculating at acceptance `alpha` beats plain decoding by the margin that leaves fallback."""
    _, rate = best_k(alpha, costs, config.k_max)
    return rate > (1.0 + config.exit_fallback_margin) / costs.verify_time(0)


def probe_can_exit(costs: CostModel, config: SpecConfig) -> bool:
    """Whether any probe could leave fallback on these costs. A probe drafts at most k_max tokens and is judged at
    acceptance accepted / (accepted + 1) (`update`), so k_max / (k_max + 1) is the best it can show; the rate rises
    with acceptance, so if that fails the bar, every probe would."""
    return passes_exit_bar(config.k_max / (config.k_max + 1), costs, config)


@dataclass(slots=True, frozen=True)
class Decision:
    """The policy's k for one round, and the fallback bookkeeping that round leaves the session with (`apply`)."""

    k: int
    fallback: bool
    rounds_since_probe: int
    probe_interval: int
    probing: bool


def decide(state: PolicyState, costs: CostModel, config: SpecConfig, prior: float | None = None) -> Decision:
    """The number of tokens to draft this round (0: plain decoding) and the state the round leaves; reads `state`
    only, so a round that does not run (its batch shrinks to fit the KV cache) can simply ask again."""
    unchanged = Decision(state.k, state.fallback, state.rounds_since_probe, state.probe_interval, state.probing)
    if not config.speculating:
        return replace(unchanged, k=0)
    if not config.adaptive or not costs.calibrated:
        return replace(unchanged, k=config.k_init)
    k, rate = best_k(acceptance(state, config, prior), costs, config.k_max)
    plain_rate = 1.0 / costs.verify_time(0)
    fallback, since, interval = state.fallback, state.rounds_since_probe, state.probe_interval
    if not fallback and rate < plain_rate * (1.0 - config.enter_fallback_margin):
        fallback, since, interval = True, 0, interval or config.probe_interval
    if not fallback:
        return Decision(k, False, since, interval, probing=False)
    since += 1
    if since < interval:
        return Decision(0, True, since, interval, probing=False)
    if not probe_can_exit(costs, config):
        # Skipped, not run: look again after a longer wait, since the measured costs may change.
        return Decision(0, True, 0, min(2 * interval, config.probe_interval_max), probing=False)
    # A probe drafts at least k_init, whatever the long-run estimate (still remembering the bad stretch) would pick.
    return Decision(max(k, config.k_init), True, 0, interval, probing=True)


def apply(state: PolicyState, decision: Decision) -> None:
    """Enter a round's decision into the session's state (before the round's outcome, `update`)."""
    state.k, state.fallback, state.probing = decision.k, decision.fallback, decision.probing
    state.rounds_since_probe, state.probe_interval = decision.rounds_since_probe, decision.probe_interval


def decoded_plainly(state: PolicyState, further: int) -> None:
    """A plain round that decoded `further` tokens past its first (multi-step decoding, core.decode_steps) counts as
    that many more rounds toward the next probe, so probes come after as many tokens as one token a round gives."""
    if state.fallback:
        state.rounds_since_probe += further


def update(state: PolicyState, k: int, accepted: int, costs: CostModel, config: SpecConfig) -> None:
    """Fold one round's outcome into the acceptance estimate; decide on leaving fallback after a probe."""
    if k == 0:
        return
    state.accepted = config.ema_decay * state.accepted + accepted
    state.rejected = config.ema_decay * state.rejected + (1 if accepted < k else 0)
    if not (state.fallback and state.probing) or not costs.calibrated:
        return
    # Judge a probe on its own evidence (the long-run estimate still remembers the bad stretch):
    # `accepted` successes followed by one failure or the end of the block.
    if passes_exit_bar(accepted / (accepted + 1), costs, config):
        state.fallback = False
        state.accepted, state.rejected = float(accepted), float(accepted < k)
        state.probe_interval = config.probe_interval
    else:
        state.probe_interval = min(2 * state.probe_interval, config.probe_interval_max)
