"""The ids and positions a forward over several sequences feeds the model, in the layout core.row_layout decided:
padded rows, or one packed row. Kept apart from the layout's decisions because the engine prices rounds with those
(through a worker's info) in processes that run no model and import no torch: a gateway over shared pools."""

from __future__ import annotations

from itertools import accumulate

import torch


def padded_inputs(fed: dict[int, list[int]], starts: list[int], lo: int, width: int, pad_token_id: int
                  ) -> tuple[torch.Tensor, torch.Tensor, dict[int, int]]:
    """ids and positions [rows, width] for slots [lo, lo + len(starts)), and where each fed slot's first token lies
    in the flattened output."""
    ids = torch.full((len(starts), width), pad_token_id, dtype=torch.long)
    for slot, new in fed.items():
        ids[slot - lo, : len(new)] = torch.tensor(new, dtype=torch.long)
    positions = torch.tensor(starts, dtype=torch.long)[:, None] + torch.arange(width)
    return ids, positions, {slot: (slot - lo) * width for slot in fed}


def packed_inputs(fed: dict[int, list[int]], starts: list[int], lo: int
                  ) -> tuple[torch.Tensor, torch.Tensor, dict[int, int]]:
    """ids and positions [1, tokens]: the fed slots' tokens in slot order, each at its own position; and where each
    fed slot's first token lies."""
    order = sorted(fed)
    ids = torch.tensor([[token for slot in order for token in fed[slot]]], dtype=torch.long)
    positions = torch.cat([torch.arange(len(fed[slot])) + starts[slot - lo] for slot in order])[None]
    first = dict(zip(order, accumulate((len(fed[slot]) for slot in order[:-1]), initial=0), strict=True))
    return ids, positions, first
