"""How one forward over several sequences lays out their new tokens: padded rows, or one packed row.

Padded: each sequence's tokens in a row of its own, every row as wide as the widest, and one attention call over
them all (a mask hides the padding). Packed: every sequence's tokens one after another in a single row, attention run
per sequence over its own cached keys (core.attention's varlen implementation, a kv_cache Step with `packed`).
Padding costs its share of every matrix product; packing costs an attention call per sequence.

Whether a padded forward pays at all decides how many forwards a set of prompts takes (prefill_many) and whether a
prompt goes into the forward that scores it (fits_one_forward): a second forward reads every weight again.

A runner's `RowLayout` makes these decisions; the batch plan reads the same object (the target's, through the
verifier and core.costs) to price a round whose rows draft different numbers of tokens as the runner will run it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.core.sequence import SequenceState

# On a GPU, rows pack once their padded area reaches this many tokens: below, a product's time grows little with its
# rows (it streams the weights), so padding is nearly free there, and one attention call beats one per row.
PACK_AREA = 256


def packing_pays(device_type: str, rows: int, area: int, tokens: int) -> bool:
    """Whether `rows` rows feeding `tokens` tokens run packed rather than padded to `area` (sdpa models). On a CPU a
    product's time grows with its rows from a few rows on, so packing pays from half a padded token per row fed
    (2-core AVX-512 EPYC, the 1.5B target, 8 rows over ~300 cached tokens, packed against padded: 303 against
    446 ms for widths 5,3,1,6,2,4,1,5; 208 against 242 ms for 2,1,1,1,1,1,1,1; 454 against 428 ms for
    5,5,5,5,5,5,5,4)."""
    if rows < 2 or area == tokens:
        return False
    return 2 * (area - tokens) >= rows if device_type == "cpu" else area >= PACK_AREA


@dataclass(slots=True, frozen=True)
class RowLayout:
    """How a runner lays out a forward's rows: packed where `packing_pays` on its `device_type` and the model
    `can_pack` (sdpa attention, core.attention's varlen implementation), else padded. `padded_up_to`: forwards no
    wider than this run padded whatever their rows' widths, over `row_buckets` rows (a compiled runner's static
    forwards, core.cuda_graphs: one graph per row bucket and width, the bucket's spare rows computed too); 0 and ()
    where none do."""

    device_type: str
    can_pack: bool
    padded_up_to: int = 0
    row_buckets: tuple[int, ...] = ()

    def to_info(self) -> dict:
        """The layout as a worker's info reports it across the pool's wire (`from_info` reads it back)."""
        return {"device_type": self.device_type, "packs_rows": self.can_pack, "pads_rows_up_to": self.padded_up_to,
                "row_buckets": list(self.row_buckets)}

    @classmethod
    def from_info(cls, info: dict) -> RowLayout:
        """The layout a worker's info reports. A worker that leaves fields out (an older one, mid-rollout) has its
        rounds priced on a CPU, padded, each row count as itself."""
        return cls(info.get("device_type", "cpu"), info.get("packs_rows", False), info.get("pads_rows_up_to", 0),
                   tuple(info.get("row_buckets", ())))

    def priced_rows(self, rows: int, width: int) -> int:
        """The rows a forward over `rows` rows of `width` tokens computes: its bucket where a static forward runs
        it, else the rows themselves. A batch down to 7 rows runs the 8-row graph, so it costs what 8 rows do."""
        if width > self.padded_up_to:
            return rows
        return next((bucket for bucket in self.row_buckets if bucket >= rows), rows)

    def packs(self, rows: int, area: int, tokens: int) -> bool:
        """Whether `rows` rows feeding `tokens` tokens, `area` padded, run packed."""
        return self.can_pack and packing_pays(self.device_type, rows, area, tokens)

    def one_forward_pays(self, rows: list[tuple[SequenceState, list[int]]]) -> bool:
        """Whether rows (in slot order) fed in one forward cost about what their tokens do: packed where packing
        pays, else padded to an area (their slots' span at the widest row's width) within twice the tokens they
        feed."""
        area = (rows[-1][0].slot - rows[0][0].slot + 1) * max(len(new) for _, new in rows)
        tokens = sum(len(new) for _, new in rows)
        return area <= 2 * tokens or self.packs(len(rows), area, tokens)

    def priced_width(self, widths: list[int]) -> float:
        """The width of the uniform forward (as many rows, each feeding it) that a forward over rows in neighbouring
        slots feeding `widths` tokens costs about: the widest where they run padded, their mean where packed (the
        products then run over their tokens alone; the per-row attention calls are left out of the price)."""
        tokens, widest = sum(widths), max(widths)
        if widest <= self.padded_up_to:
            return float(widest)
        return tokens / len(widths) if self.packs(len(widths), len(widths) * widest, tokens) else float(widest)

