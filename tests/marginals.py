"""A sampled engine's second tokens against the distribution they must follow: the check that a speculative step
leaves the target's distribution exact, shared by the engine's tests."""

from __future__ import annotations

import torch
from scipy.stats import chisquare


def assert_second_tokens_follow(results, p_first: torch.Tensor, support: list[int], p_second: torch.Tensor) -> None:
    """The second token of each result (GenerationResult) against sum_t p(t) p(. | t): `p_first` [V] the first
    token's probabilities, `support` the ids where it is above zero, `p_second` [len(support), V] the second token's
    given each of them. Chi-square (bins expecting under 5 pooled) p > 1e-4, total variation < 0.06, nothing outside
    the support."""
    expected = (p_first[support].unsqueeze(-1) * p_second).sum(0).double()
    expected /= expected.sum()  # float32 probabilities sum to 1 within ~1e-7
    counts = torch.bincount(torch.tensor([r.token_ids[1] for r in results]), minlength=expected.shape[0]).double()
    assert counts[expected == 0].sum() == 0
    keep = expected * len(results) >= 5
    observed, wanted = counts[keep], expected[keep] * len(results)
    if expected[~keep].sum() > 0:  # the pooled bin, where there is one (a min-p filter may leave none)
        observed = torch.cat([observed, counts[~keep].sum().reshape(1)])
        wanted = torch.cat([wanted, expected[~keep].sum().reshape(1) * len(results)])
    _, p_value = chisquare(observed.numpy(), wanted.numpy() * observed.sum().item() / wanted.sum().item())
    assert p_value > 1e-4
    assert 0.5 * (counts / counts.sum() - expected).abs().sum() < 0.06


def two_token_marginals(model, prompt: list[int], params) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """What assert_second_tokens_follow compares against, computed by `model` alone: the first token's processed
    probabilities after `prompt` under `params` (core.sampling.SamplingParams), the ids it may take, and the second
    token's probabilities given each of them."""
    from tandem.core.sampling import processed_probs

    with torch.inference_mode():
        p_first = processed_probs(model(torch.tensor([prompt])).logits[0, -1:], params)[0]
        support = p_first.nonzero().flatten()
        batch = torch.tensor([prompt + [int(t)] for t in support])
        p_second = processed_probs(model(batch).logits[:, -1], params)
    return p_first, support.tolist(), p_second
