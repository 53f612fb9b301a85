"""Measured costs of the two forwards a round is made of: draft steps, and target forwards over n tokens."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported for the annotation only: this module stays free of torch
    from tandem.core.row_layout import RowLayout

MEASURED_FIELDS = ("draft_step", "verify", "draft_rows", "batched", "draft_forward")
CATCH_UP_ALONE_ABOVE = 2  # a batched drafter row further behind than this catches up in a forward of its own


def _at_least_narrower(points: dict, n: int, seconds: float) -> float:
    """A forward over more tokens is never priced below a measured narrower one. Observations move a table's
    calibrated widths together (CostModel.observe_verify), but a width first timed in service was never timed
    beside the others, and one slow spell there may leave it above a wider one."""
    return max([seconds, *(s for size, s in points.items() if size < n)])


def _robust_line(points: dict[int, float], n: int) -> float:
    """The Theil-Sen line through the points at n: the median of the pairwise slopes (never below 0: a bigger forward
    never costs less), through the median of the points. Each point is a timing on a machine that swings (one table
    here held 8 rows x 7 tokens at 0.15 s and 8 x 9 at 0.32 s); priced point by point, one slow timing makes a shape
    look dearer than its neighbours and the plan avoids it for good, so it is never timed again. The line is priced
    from all of them, and one or two outliers move it little."""
    sizes = sorted(points)
    slopes = sorted((points[b] - points[a]) / (b - a) for i, a in enumerate(sizes) for b in sizes[i + 1:])
    slope = max(_median(slopes), 0.0)
    intercept = _median(sorted(points[s] - slope * s for s in sizes))
    return max(intercept + slope * n, 1e-9)


def _median(values: list[float]) -> float:
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2


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
    target forward: `verify` for one sequence keyed by the tokens it feeds (k drafts + 1), `batched` for several
    rows keyed by (rows, padded width); `draft_forward` for one sequence's draft forward over n tokens (a drafter
    catching up on tokens decoded without it). The per-session policy reads only the single-sequence costs.

    Single-sequence forwards are priced point by point (interpolated between measured sizes); batched ones and draft
    steps over several rows along a robust line (`_robust_line`) through the widths measured with as many rows (draft
    steps: through the row counts). A row count measured at one width only follows, from it, the curve of the row
    counts around it measured at several widths (the single-sequence curve where there are none); an unmeasured row
    count is interpolated between the measured row counts around it, or scaled from the nearest one along the
    single-sequence curve. Observations are blended in with an exponential moving average.

    `layout` is not measured: it is how the target lays out a forward's rows (its runner's RowLayout, given by the
    engine from its verifier), so that the batch plan prices rows of different widths as they run (None: padded),
    and a batch as the rows its forward computes: a compiled runner's bucket (7 rows run as 8), whose table every
    such forward times and prices. A row count with a table of its own starts from its first timings alone, not
    priced wider along the single-sequence curve: one that first ran a plain round would read as too dear to draft,
    its rounds would stay plain, and its wider widths would never be timed (docs/performance.md, "A batch priced as
    the rows its forward computes").
    """

    draft_step: float = 0.0
    verify: dict[int, float] = field(default_factory=dict)
    draft_rows: dict[int, float] = field(default_factory=dict)
    batched: dict[tuple[int, int], float] = field(default_factory=dict)
    draft_forward: dict[int, float] = field(default_factory=dict)
    smoothing: float = 0.2
    frozen: bool = False
    layout: RowLayout | None = None

    def observe_draft_step(self, seconds: float, rows: int = 1) -> None:
        if self.frozen:
            return
        if rows <= 1:
            self.draft_step = seconds if self.draft_step == 0.0 else self._blend(self.draft_step, seconds)
            return
        old = self.draft_rows.get(rows)
        self.draft_rows[rows] = seconds if old is None else self._blend(old, seconds)

    def observe_verify(self, tokens: int, seconds: float, rows: int = 1) -> None:
        """A target forward over `rows` rows of `tokens` tokens each (padded width). The other widths with as
        many rows move by the same factor: the machine's speed drifts (other processes, clocks) for every width
        alike, while rounds keep re-measuring the widths they use. Were only those to follow, a machine that sped up
        during plain rounds would leave every wider forward priced at the slower past, drafting would look dearer
        than it is, and the plain rounds that followed would only deepen it. The widths' relative costs stay those
        calibration measured side by side."""
        if self.frozen:
            return
        if rows > 1 and self.layout is not None:
            rows = self.layout.priced_rows(rows, tokens)
        table, key = (self.verify, tokens) if rows <= 1 else (self.batched, (rows, tokens))
        old = table.get(key)
        if old is None:
            table[key] = seconds
            return
        factor = self._blend(old, seconds) / old
        for other in [k for k in table if k == key or rows <= 1 or k[0] == rows]:
            table[other] *= factor

    def verify_time(self, k: int) -> float:
        """Seconds to verify k draft tokens of one sequence (a forward over k + 1 tokens)."""
        return self.forward_time(k + 1)

    def round_time(self, k: int) -> float:
        """Seconds of one sequence's round: k draft steps, then the verification of the k drafts."""
        return k * self.draft_step + self.verify_time(k)

    def forward_time(self, tokens: int) -> float:
        """Seconds for one single-sequence target forward feeding `tokens` tokens."""
        return _at_least_narrower(self.verify, tokens, _interpolate(self.verify, tokens))

    def batch_forward_time(self, rows: int, width: int) -> float:
        """Seconds for a target forward over `rows` rows padded to `width` tokens each (timed and priced as the rows
        its runner computes, `layout`'s bucket)."""
        if rows <= 1:
            return self.forward_time(width)
        if self.layout is not None:
            rows = self.layout.priced_rows(rows, width)
        measured_rows = sorted({r for r, _ in self.batched})
        if rows in measured_rows:
            return self._at_measured_rows(rows, width)
        below, above = [r for r in measured_rows if r < rows], [r for r in measured_rows if r > rows]
        if below and above:
            return self._between_rows(below[-1], above[0], rows, width)
        if not measured_rows:
            return self.forward_time(rows * width)
        nearest = below[-1] if below else above[0]
        return (self._at_measured_rows(nearest, width) * self.forward_time(rows * width)
                / self.forward_time(nearest * width))

    def _at_measured_rows(self, rows: int, width: int) -> float:
        """A line through the widths measured with `rows` rows (one width: `_width_growth` from it), never
        below the one-token forward's own price. Every plain round re-times that shape, so its price is current and
        no lone outlier; the line, fit to a curve that is flat at first (weights-bound) and then climbs, runs below
        it there (on CPU-A 0.118-0.125 s at 8 rows, while plain rounds timed 0.14-0.15 s), and priced plain decoding
        of a batch as cheaper than it is."""
        widths = {w: seconds for (r, w), seconds in self.batched.items() if r == rows}
        if len(widths) == 1:
            (only, seconds), = widths.items()
            return seconds * self._width_growth(rows, only, width)
        return max(_robust_line(widths, width), widths.get(1, 0.0))

    def _width_growth(self, rows: int, only: int, width: int) -> float:
        """How much a forward over `rows` rows, timed at width `only` alone, costs more at `width`: as at the row
        counts around it that were timed at several widths (interpolated between the two that bracket it, else the
        nearest), or, with none, along the single-sequence curve. A row count first met in plain rounds (a batch
        down to 7 rows as requests finish) is timed at width 1 only; priced along the single-sequence curve, which
        climbs faster than a batch's (7 rows x 2 tokens at 1.5x their plain step, where 8 rows cost 1.3x), its
        rounds would look too dear to draft, stay plain, and never time its wider widths."""
        counts = Counter(r for r, _ in self.batched)
        curved = sorted(r for r, n in counts.items() if n > 1)
        if not curved:
            return self.forward_time(rows * width) / self.forward_time(rows * only)
        below, above = [r for r in curved if r < rows], [r for r in curved if r > rows]
        if below and above:
            lo, hi = below[-1], above[0]
            return self._between_rows(lo, hi, rows, width) / self._between_rows(lo, hi, rows, only)
        nearest = below[-1] if below else above[0]
        return self._at_measured_rows(nearest, width) / self._at_measured_rows(nearest, only)

    def _between_rows(self, lo: int, hi: int, rows: int, width: int) -> float:
        """A forward over `rows` rows of `width` tokens, on the line between the measured row counts lo and hi."""
        low, high = self._at_measured_rows(lo, width), self._at_measured_rows(hi, width)
        return low + (high - low) * (rows - lo) / (hi - lo)

    def draft_time(self, rows: int) -> float:
        """Seconds for one draft step over `rows` sequences."""
        if rows <= 1:
            return self.draft_step
        points = self.draft_rows | ({1: self.draft_step} if self.draft_step else {})
        return _robust_line(points, rows) if len(points) > 1 else _interpolate(points, rows)

    def catch_up_time(self, behind: int) -> float:
        """Seconds a batched round spends bringing one drafter row that is `behind` tokens behind up to date: all
        but the last token run alone first (the last goes with the batch's first draft step). A backlog wider than
        the widest forward measured is priced as that many forwards of it: in a batch a far row catches up at most
        batch_catch_up_limit tokens a round (core.round_plan), the widest width calibration times. Extrapolated
        along a table that is flat up to there (weights-bound forwards), 140 tokens were once priced as 32."""
        if behind <= CATCH_UP_ALONE_ABOVE:
            return 0.0
        points = self.draft_forward | ({1: self.draft_step} if self.draft_step else {})
        tokens, widest = behind - 1, max(points, default=0)
        if widest and tokens > widest:
            return points[widest] * tokens / widest
        return _interpolate(points, tokens)

    def adopt(self, measured: CostModel) -> None:
        """Take every measured cost from `measured`, keeping this model's smoothing and frozen flag."""
        for name in MEASURED_FIELDS:
            setattr(self, name, getattr(measured, name))

    @property
    def calibrated(self) -> bool:
        return self.draft_step > 0.0 and 1 in self.verify

    def _blend(self, old: float, new: float) -> float:
        # A stall (another process, a first call of a new shape) may double the estimate at most.
        return old + self.smoothing * max(-0.5 * old, min(new - old, old))

    def to_dict(self) -> dict:
        return {"draft_step": self.draft_step, "verify": {str(n): t for n, t in sorted(self.verify.items())},
                "draft_rows": {str(n): t for n, t in sorted(self.draft_rows.items())},
                "batched": {f"{r}x{w}": t for (r, w), t in sorted(self.batched.items())},
                "draft_forward": {str(n): t for n, t in sorted(self.draft_forward.items())}}

    @classmethod
    def from_dict(cls, measured: dict) -> CostModel:
        """The measured costs `to_dict` wrote (a stored calibration)."""
        def sizes(name: str) -> dict[int, float]:
            return {int(n): float(t) for n, t in measured.get(name, {}).items()}

        batched = {tuple(int(x) for x in key.split("x")): float(t) for key, t in measured.get("batched", {}).items()}
        return cls(draft_step=float(measured.get("draft_step", 0.0)), verify=sizes("verify"),
                   draft_rows=sizes("draft_rows"), batched=batched, draft_forward=sizes("draft_forward"))
