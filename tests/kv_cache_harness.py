"""What the KV cache's test modules (tests/test_kv_cache_*.py) share: the tolerance logits must agree within, a
seeded run of token ids, and the logits of the model over a whole sequence with no cache."""

from __future__ import annotations

import torch

TIGHT = {"rtol": 1e-5, "atol": 1e-5}


def _tokens(seed: int, count: int) -> list[int]:
    return torch.randint(3, 300, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def _recomputed(model, tokens: list[int], want: int) -> torch.Tensor:
    """The model over the whole sequence with no cache at all."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0, len(tokens) - want :].float()
