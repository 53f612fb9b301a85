"""Batch-level choice between speculative and plain rounds, from goodput measured at each batch size.

Per-session policies price k with single-sequence costs. With several sequences in a step, a plain round costs
little more than one sequence's (memory-bound weights are read once), while drafting and verifying k + 1 tokens per
row grows with the batch; speculation can then lose to plain decoding. So for every batch size the engine keeps the
measured goodput (tokens emitted per second of step) of both kinds of round, runs the better one, and re-measures the
other every `explore_every` rounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SPECULATE, PLAIN = "speculate", "plain"


@dataclass(slots=True)
class ArmStats:
    goodput: float = 0.0
    rounds: int = 0


@dataclass(slots=True)
class BatchArms:
    explore_every: int = 16
    smoothing: float = 0.3
    arms: dict[tuple[int, str], ArmStats] = field(default_factory=dict)
    rounds: dict[int, int] = field(default_factory=dict)

    def choose(self, batch_size: int) -> str:
        if batch_size <= 1:
            return SPECULATE
        spec, plain = self._arm(batch_size, SPECULATE), self._arm(batch_size, PLAIN)
        for arm, stats in ((SPECULATE, spec), (PLAIN, plain)):
            if stats.rounds == 0:
                return arm
        best, other = (SPECULATE, PLAIN) if spec.goodput >= plain.goodput else (PLAIN, SPECULATE)
        count = self.rounds.get(batch_size, 0)
        return other if count % self.explore_every == self.explore_every - 1 else best

    def observe(self, batch_size: int, arm: str, tokens: int, seconds: float) -> None:
        if batch_size <= 1 or seconds <= 0:
            return
        self.rounds[batch_size] = self.rounds.get(batch_size, 0) + 1
        stats = self._arm(batch_size, arm)
        goodput = tokens / seconds
        stats.goodput = goodput if stats.rounds == 0 else stats.goodput + self.smoothing * (goodput - stats.goodput)
        stats.rounds += 1

    def _arm(self, batch_size: int, arm: str) -> ArmStats:
        return self.arms.setdefault((batch_size, arm), ArmStats())

    def to_dict(self) -> dict:
        return {f"{b}:{arm}": round(s.goodput, 3) for (b, arm), s in sorted(self.arms.items())}
