"""Turning logits into the distributions that drafting and verification sample from.

The same `processed_probs` runs on draft and target logits, so both sides see temperature, top-k and top-p
applied identically; verification then makes the output follow the target's processed distribution exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.core.config import SamplingParams


@dataclass(slots=True)
class SparseDist:
    """A distribution over a few token ids: the exact truncated draft distribution a token was drawn from."""

    ids: torch.Tensor  # [n, m] int64
    probs: torch.Tensor  # [n, m] float64, rows sum to 1

    def to_dense(self, vocab_size: int) -> torch.Tensor:
        dense = torch.zeros(self.ids.shape[0], vocab_size, dtype=torch.float64)
        return dense.scatter_add_(1, self.ids, self.probs)


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, V] logits -> [n, V] float64 probabilities after temperature, top-k and top-p (one-hot if greedy)."""
    logits = logits.to(torch.float64)
    if params.greedy:
        probs = torch.zeros_like(logits)
        return probs.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it already does.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)


def truncate_top_m(probs: torch.Tensor, m: int) -> SparseDist:
    """Keep the m most likely ids of each row and renormalise: small enough to send over a network."""
    m = min(m, probs.shape[-1])
    top = torch.topk(probs, m, dim=-1)
    kept = top.values
    return SparseDist(ids=top.indices, probs=kept / kept.sum(dim=-1, keepdim=True))


def sample_index(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: row i of [n, V] probs with its own uniform in [0, 1)."""
    cdf = probs.cumsum(dim=-1)
    target = uniform.to(cdf.dtype).unsqueeze(-1) * cdf[:, -1:]
    index = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return index.clamp_(max=probs.shape[-1] - 1)


def make_generator(seed: int | None) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
    return generator


def uniforms(generator: torch.Generator, n: int) -> torch.Tensor:
    return torch.rand(n, generator=generator, dtype=torch.float64)
