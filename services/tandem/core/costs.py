"""Measured costs of the two forwards a round is made of: draft steps, and target forwards over n tokens."""

from __future__ import annotations

from dataclasses import dataclass, field


def _interpolate(points: dict[int, float], n: int) -> float:
    """Linear between measured sizes, extrapolated from the nearest two at the ends."""
    if n in points:
        return points[n]
    if not points:
        return 1.0
    sizes = sorted(points)
    if len(sizes) == 1:
        return points[sizes[0]] * n / sizes[0]
    below = [s for s in sizes if s < n]
    above = [s for s in sizes if s > n]
    if below and above:
        lo, hi = below[-1], above[0]
    else:
        lo, hi = (sizes[-2], sizes[-1]) if below else (sizes[0], sizes[1])
    slope = (points[hi] - points[lo]) / (hi - lo)
    return max(points[lo] + slope * (n - lo), 1e-9)


@dataclass(slots=True)
class CostModel:
    """Seconds per draft step (one row, and `draft_rows` for steps over several rows at once), and seconds per
    target forward keyed by the tokens it feeds (k drafts + 1 for one sequence; rows x padded width for a batch).

    Unmeasured sizes are interpolated. Observations are blended in with an exponential moving average.
    """

    draft_step: float = 0.0
    verify: dict[int, float] = field(default_factory=dict)
    draft_rows: dict[int, float] = field(default_factory=dict)
    smoothing: float = 0.2
    frozen: bool = False

    def observe_draft_step(self, seconds: float, rows: int = 1) -> None:
        if self.frozen:
            return
        if rows <= 1:
            self.draft_step = seconds if self.draft_step == 0.0 else self._blend(self.draft_step, seconds)
            return
        old = self.draft_rows.get(rows)
        self.draft_rows[rows] = seconds if old is None else self._blend(old, seconds)

    def observe_verify(self, tokens: int, seconds: float) -> None:
        if self.frozen:
            return
        old = self.verify.get(tokens)
        self.verify[tokens] = seconds if old is None else self._blend(old, seconds)

    def verify_time(self, k: int) -> float:
        """Seconds to verify k draft tokens of one sequence (a forward over k + 1 tokens)."""
        return self.forward_time(k + 1)

    def forward_time(self, tokens: int) -> float:
        """Seconds for one target forward feeding `tokens` tokens in all."""
        return _interpolate(self.verify, tokens)

    def draft_time(self, rows: int) -> float:
        """Seconds for one draft step over `rows` sequences."""
        if rows <= 1:
            return self.draft_step
        return _interpolate(self.draft_rows | ({1: self.draft_step} if self.draft_step else {}), rows)

    @property
    def calibrated(self) -> bool:
        return self.draft_step > 0.0 and 1 in self.verify

    def _blend(self, old: float, new: float) -> float:
        # A stall (another process, a first call of a new shape) may double the estimate at most.
        return old + self.smoothing * max(-0.5 * old, min(new - old, old))

    def to_dict(self) -> dict:
        return {"draft_step": self.draft_step, "verify": {str(n): t for n, t in sorted(self.verify.items())},
                "draft_rows": {str(n): t for n, t in sorted(self.draft_rows.items())}}
