"""Measured costs of the two forwards a round is made of: one draft step, and verification of n tokens."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CostModel:
    """Seconds per draft forward, and seconds per target forward keyed by tokens fed (k drafts + 1).

    Unmeasured verify sizes are interpolated linearly between measured ones (extrapolated at the ends).
    Observations are blended in with an exponential moving average.
    """

    draft_step: float = 0.0
    verify: dict[int, float] = field(default_factory=dict)
    smoothing: float = 0.2
    frozen: bool = False

    def observe_draft_step(self, seconds: float) -> None:
        if self.frozen:
            return
        self.draft_step = seconds if self.draft_step == 0.0 else self._blend(self.draft_step, seconds)

    def observe_verify(self, tokens: int, seconds: float) -> None:
        if self.frozen:
            return
        old = self.verify.get(tokens)
        self.verify[tokens] = seconds if old is None else self._blend(old, seconds)

    def verify_time(self, k: int) -> float:
        """Seconds to verify k draft tokens (a forward over k + 1 tokens)."""
        n = k + 1
        if n in self.verify:
            return self.verify[n]
        if not self.verify:
            return 1.0
        sizes = sorted(self.verify)
        if len(sizes) == 1:
            return self.verify[sizes[0]] * n / sizes[0]
        below = [s for s in sizes if s < n]
        above = [s for s in sizes if s > n]
        if below and above:
            lo, hi = below[-1], above[0]
        else:
            lo, hi = (sizes[-2], sizes[-1]) if below else (sizes[0], sizes[1])
        slope = (self.verify[hi] - self.verify[lo]) / (hi - lo)
        return max(self.verify[lo] + slope * (n - lo), 1e-9)

    @property
    def calibrated(self) -> bool:
        return self.draft_step > 0.0 and 1 in self.verify

    def _blend(self, old: float, new: float) -> float:
        # A stall (another process, a first call of a new shape) may double the estimate at most.
        return old + self.smoothing * max(-0.5 * old, min(new - old, old))

    def to_dict(self) -> dict:
        return {"draft_step": self.draft_step, "verify": {str(n): t for n, t in sorted(self.verify.items())}}
