"""Per-request speculation statistics, and the report of them each finished request carries to the layers above."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypedDict


class SpeculationReport(TypedDict):
    """What a finished request's speculation did, as the engine reports it to the gateway, the CLI and the benches
    (GenerationResult.stats, and on as ChoiceEnd.stats): every key always present. Plain data, so that the HTTP API
    can show it whole (a response's `speculation`) and a bench can write it as it is."""

    rounds: int
    spec_rounds: int
    fallback_rounds: int
    drafted: int
    accepted: int
    acceptance_rate: float
    mean_accepted_length: float  # tau: tokens per speculative round
    acceptance_per_position: list[float]
    draft_seconds: float
    verify_seconds: float
    draft_failures: int
    rounds_by_k: dict[str, int]
    cached_prompt_tokens: int
    block_tokens: int
    predicted_rounds: int
    accepted_prediction_tokens: int  # OpenAI's names: predicted tokens accepted as drafts, and those refused
    rejected_prediction_tokens: int
    lookup_rounds: int
    accepted_lookup_tokens: int
    rejected_lookup_tokens: int
    fallback: bool  # the request's policy ended in fallback (plain decoding)
    final_k: int


@dataclass(slots=True)
class RequestStats:
    rounds: int = 0
    spec_rounds: int = 0
    fallback_rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted_in_spec_rounds: int = 0
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    draft_failures: int = 0
    rounds_by_k: dict[int, int] = field(default_factory=dict)
    cached_prompt_tokens: int = 0  # prompt tokens the target found cached (a session's or a shared prefix)
    # Tokens rounds decoded past their first, one target forward each, in one verify call (EngineConfig.decode_steps)
    block_tokens: int = 0
    # Rounds whose drafts came from the request's prediction (core.prediction), and their tokens: apart from the
    # draft model's, whose acceptance the fields above measure.
    predicted_rounds: int = 0
    prediction_accepted: int = 0
    prediction_rejected: int = 0
    # Rounds whose drafts came from the request's own context (core.prompt_lookup), and their tokens.
    lookup_rounds: int = 0
    lookup_accepted: int = 0
    lookup_rejected: int = 0

    def record_round(self, k: int, accepted: int, fallback: bool, more: int = 0) -> None:
        """`more`: the tokens the round's verify call decoded after its first (a multi-step block)."""
        self.rounds += 1
        self.block_tokens += more
        self.rounds_by_k[k] = self.rounds_by_k.get(k, 0) + 1
        if k == 0:
            self.fallback_rounds += int(fallback)
            return
        self.spec_rounds += 1
        self.drafted += k
        self.accepted += accepted
        self.emitted_in_spec_rounds += accepted + 1
        while len(self.drafted_at) < k:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for position in range(k):
            self.drafted_at[position] += 1
            self.accepted_at[position] += int(position < accepted)

    def record_predicted_round(self, accepted: int, rejected: int) -> None:
        """A round that drafted from the request's prediction: of its drafts the output holds, those accepted and
        those refused."""
        self.rounds += 1
        self.predicted_rounds += 1
        self.prediction_accepted += accepted
        self.prediction_rejected += rejected

    def record_lookup_round(self, accepted: int, rejected: int) -> None:
        """A round that drafted from the request's context (prompt lookup), counted as record_predicted_round's."""
        self.rounds += 1
        self.lookup_rounds += 1
        self.lookup_accepted += accepted
        self.lookup_rejected += rejected

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """tau: tokens emitted per speculative round (accepted drafts plus the target's own token)."""
        return self.emitted_in_spec_rounds / self.spec_rounds if self.spec_rounds else 0.0

    def report(self, fallback: bool, final_k: int) -> SpeculationReport:
        """The finished request's report; `fallback` and `final_k`: where its policy ended."""
        return SpeculationReport(
            rounds=self.rounds,
            spec_rounds=self.spec_rounds,
            fallback_rounds=self.fallback_rounds,
            drafted=self.drafted,
            accepted=self.accepted,
            acceptance_rate=round(self.acceptance_rate, 4),
            mean_accepted_length=round(self.mean_accepted_length, 4),
            acceptance_per_position=[
                round(a / d, 4) if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at, strict=True)
            ],
            draft_seconds=round(self.draft_seconds, 6),
            verify_seconds=round(self.verify_seconds, 6),
            draft_failures=self.draft_failures,
            rounds_by_k={str(k): n for k, n in sorted(self.rounds_by_k.items())},
            cached_prompt_tokens=self.cached_prompt_tokens,
            block_tokens=self.block_tokens,
            predicted_rounds=self.predicted_rounds,
            accepted_prediction_tokens=self.prediction_accepted,
            rejected_prediction_tokens=self.prediction_rejected,
            lookup_rounds=self.lookup_rounds,
            accepted_lookup_tokens=self.lookup_accepted,
            rejected_lookup_tokens=self.lookup_rejected,
            fallback=fallback,
            final_k=final_k,
        )
