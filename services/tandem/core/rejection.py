"""The speculative acceptance step: pure functions over draft proposals and target distributions.

Rule (Leviathan et al. 2023; Chen et al. 2023): draft token d_i, drawn from q_i, is accepted with probability
min(1, p_i(d_i) / q_i(d_i)). At the first rejection the next token is drawn from norm(max(0, p_i - q_i)); when all
k are accepted a bonus token is drawn from p_{k+1}. The output then follows p exactly, for ANY q, so q may be the
truncated top-m distribution the draft really sampled from. Greedy (one-hot p and q) reduces to: accept while
d_i == argmax p_i, then emit argmax p at the first mismatch (or the bonus position).
A request with a client's seed uses the greedy rule too, on choices both sides make with the same Gumbel noise keyed
by token position (core.sampling.gumbel_choice): the output is then the very tokens plain decoding gives that seed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.core.sampling import SparseDist, sample_index


def accept_greedy(draft_tokens: Sequence[int] | torch.Tensor,
                  target_choices: Sequence[int] | torch.Tensor) -> tuple[int, int]:
    """draft_tokens [k], the target's choices [k+1] (argmax, or seeded Gumbel-max) -> (number accepted, next
    token). On the host: the choices arrive there in one transfer per step."""
    drafts, choices = [int(t) for t in draft_tokens], [int(t) for t in target_choices]
    accepted = next((i for i, (d, c) in enumerate(zip(drafts, choices, strict=False)) if d != c), len(drafts))
    return accepted, choices[accepted]


def accept_sampled(
    draft_tokens: torch.Tensor,
    draft_dist: SparseDist,
    target_probs: torch.Tensor,
    accept_uniforms: torch.Tensor,
    resample_uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched over independent trials.

    draft_tokens [B, k]; draft_dist ids/probs [B, k, m]; target_probs [B, k+1, V] (float32 or float64, on any
    device: the work follows it); accept_uniforms [B, k]; resample_uniforms [B, k+1], one per position the emitted
    token may land on (the numbers are keyed by position, so each is used for at most one emitted token). Returns
    (accepted [B], next_token [B]) on target_probs' device.
    """
    batch, k = draft_tokens.shape
    vocab = target_probs.shape[-1]
    dtype, device = target_probs.dtype, target_probs.device
    p_of_draft = target_probs[:, :k].gather(2, draft_tokens.unsqueeze(-1)).squeeze(-1)
    q_of_draft = ((draft_dist.ids == draft_tokens.unsqueeze(-1)) * draft_dist.probs.to(dtype)).sum(-1)
    accept = accept_uniforms.to(dtype) * q_of_draft < p_of_draft
    accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)

    rows = torch.arange(batch, device=device)
    at = accepted.clamp(max=k - 1)
    q_dense = torch.zeros(batch, vocab, dtype=dtype, device=device).scatter_add_(
        1, draft_dist.ids[rows, at], draft_dist.probs[rows, at].to(dtype)
    )
    residual = (target_probs[rows, at] - q_dense).clamp_(min=0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    # A zero residual only arises from rounding when p == q; p itself is then the right distribution.
    residual = torch.where(mass > 0, residual, target_probs[rows, at])
    bonus = target_probs[:, k]
    final = torch.where((accepted == k).unsqueeze(-1), bonus, residual)
    return accepted, sample_index(final, resample_uniforms[rows, accepted])
