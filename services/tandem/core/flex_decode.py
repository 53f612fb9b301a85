"""Decode attention over each row's live keys only, split across thread blocks: PyTorch's flex_attention.

Why: inside a CUDA graph the runner's attention reads every position of the cache's buffers under a mask
(core.cuda_graphs), and sdpa's kernels walk a head's keys one tile after another. On an H200 one attention call of a
decode step took 15.5 us over 256 buffered keys and 88.5 us over 4096, for the same live keys (docs/performance.md,
"On a GPU"): at 28 layers a cache that once held a 4096-token sequence makes every later step of every row pay
2.5 ms of attention, as much as the rest of the forward. flex_attention's decoding kernel splits the keys across
thread blocks (as flash-decoding does) and skips the blocks a block mask marks empty, so each row reads its own live
blocks, and the block mask is built here from tensors whose shapes are the step's, so one CUDA graph replays it
for any lengths.

flex_attention is fast only when compiled (uncompiled it computes the full score matrix), so core.attention routes
to it only inside compiled forwards, and only when `core.attention.FLEX` is set (`TANDEM_GPU_ATTENTION=flex`). It is
not the default: on an H200 one batch-1 forward ran 1.05x faster with it, but end to end and at batch 8 it is not
yet settled against sdpa (docs/performance.md, "On a GPU"; `python -m tandem.bench.gpu_probe --only-attention flex`).
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

BLOCK = 128  # keys per block (and queries: a decode step's few queries fit one block)


def live_block_mask(mask: torch.Tensor | None, rows: int, width: int, length: int,
                    device: torch.device) -> BlockMask:
    """A block mask over `length` keys per row: a row's blocks up to the last key its mask allows ([rows, 1, width,
    length] booleans; None: every key), partial, so flex_attention also applies `mask` within them."""
    blocks = -(-length // BLOCK)
    if mask is None:
        reach = torch.full((rows,), length, device=device)
        mask_mod = None
    else:
        allowed = mask[:, 0].any(dim=1)  # [rows, length]: keys some query of the row sees
        reach = (allowed * torch.arange(1, length + 1, device=device)).amax(dim=-1)

        def mask_mod(b, h, q_idx, kv_idx):
            return mask[b, 0, q_idx, kv_idx]

    live = ((reach + BLOCK - 1) // BLOCK).to(torch.int32).view(rows, 1, 1)
    order = torch.arange(blocks, dtype=torch.int32, device=device).expand(rows, 1, 1, blocks)
    return BlockMask.from_kv_blocks(live, order, BLOCK_SIZE=(BLOCK, BLOCK), mask_mod=mask_mod,
                                    seq_lengths=(width, length), compute_q_blocks=False)


def flex_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                scale: float | None = None) -> torch.Tensor:
    """query [rows, heads, width, dim]; key and value [rows, kv_heads, length, dim], query head h reading key/value
    head h // (heads // kv_heads), as sdpa with enable_gqa; mask [rows, 1, width, length] booleans or None. Returns
    [rows, heads, width, dim]."""
    rows, _, width, _ = query.shape
    block_mask = live_block_mask(mask, rows, width, key.shape[2], query.device)
    return flex_attention(query, key, value, block_mask=block_mask, scale=scale,
                          enable_gqa=query.shape[1] != key.shape[1])
