"""Request arrival schedules: Poisson or gamma inter-arrival gaps at a given rate, seeded (as vLLM's `bench serve`).

Gaps are gamma distributed with shape = burstiness and scale = 1 / (rate * burstiness), so the mean gap is always
1 / rate while the variance is 1 / (rate**2 * burstiness): burstiness 1.0 is a Poisson process (exponential gaps),
below 1 is burstier, above 1 is more regular. An infinite rate sends every request at time 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(slots=True, frozen=True)
class ArrivalProcess:
    rate: float  # requests per second; math.inf sends everything at once
    burstiness: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.rate > 0):
            raise ValueError(f"rate: must be positive, got {self.rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"burstiness: must be a positive number, got {self.burstiness}")

    @property
    def poisson(self) -> bool:
        return self.burstiness == 1.0

    def gaps(self, count: int) -> np.ndarray:
        """`count` inter-arrival gaps in seconds; the first request waits gaps[0] after the start."""
        if count < 0:
            raise ValueError(f"count: must not be negative, got {count}")
        if math.isinf(self.rate):
            return np.zeros(count)
        generator = np.random.default_rng(self.seed)
        if self.poisson:
            return generator.exponential(1.0 / self.rate, size=count)
        return generator.gamma(shape=self.burstiness, scale=1.0 / (self.rate * self.burstiness), size=count)

    def offsets(self, count: int, first_at_zero: bool = True) -> np.ndarray:
        """Send times in seconds from the start. With first_at_zero the first request goes at once (as vLLM, whose
        first request is sent before the first sleep) and the remaining count - 1 gaps follow it."""
        if not first_at_zero:
            return np.cumsum(self.gaps(count))
        if count == 0:
            return np.zeros(0)
        return np.concatenate([[0.0], np.cumsum(self.gaps(count - 1))])


def parse_rate(text: str) -> float:
    """'2.5' -> 2.5, 'inf' -> math.inf; anything not positive raises ValueError."""
    rate = float(text)
    if math.isnan(rate) or rate <= 0:
        raise ValueError(f"must be a positive number or inf, got {text!r}")
    return rate
