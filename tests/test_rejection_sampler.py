"""The acceptance rule makes the output follow the target distribution exactly, whatever the draft proposes."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from tandem.core.config import SamplingParams
from tandem.core.rejection import accept_greedy, accept_sampled
from tandem.core.sampling import SparseDist, processed_probs, truncate_top_m

TRIALS = 200_000
VOCAB = 8


def _run_block(p: torch.Tensor, q: torch.Tensor, top_m: int,
               seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """p [k+1, V] target, q [k, V] draft. Returns accepted, emitted first token, emitted second token (or -1)."""
    generator = torch.Generator().manual_seed(seed)
    k = q.shape[0]
    dists = [truncate_top_m(q[i : i + 1], top_m) for i in range(k)]
    picks = [torch.multinomial(d.probs.expand(TRIALS, -1), 1, replacement=True, generator=generator) for d in dists]
    draft_tokens = torch.cat([d.ids[0][pick] for d, pick in zip(dists, picks, strict=True)], dim=1)
    dist = SparseDist(
        ids=torch.stack([d.ids[0] for d in dists]).expand(TRIALS, -1, -1),
        probs=torch.stack([d.probs[0] for d in dists]).expand(TRIALS, -1, -1),
    )
    accepted, next_token = accept_sampled(
        draft_tokens, dist, p.expand(TRIALS, -1, -1),
        torch.rand(TRIALS, k, generator=generator, dtype=torch.float64),
        torch.rand(TRIALS, k + 1, generator=generator, dtype=torch.float64),
    )
    first = torch.where(accepted > 0, draft_tokens[:, 0], next_token)
    second = torch.where(accepted > 1, draft_tokens[:, 1], next_token)
    second = torch.where(accepted > 0, second, torch.full_like(second, -1))
    return accepted, first, second


def _assert_matches(samples: torch.Tensor, expected: torch.Tensor) -> None:
    counts = torch.bincount(samples, minlength=VOCAB).double()
    total = counts.sum()
    expected = expected.double() / expected.double().sum()  # float32 probabilities sum to 1 within ~1e-7
    tv = 0.5 * (counts / total - expected).abs().sum().item()
    assert tv < 0.01, f"total variation {tv:.4f} between samples and target"
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled a token the target gives probability zero"
    _, p_value = chisquare(counts[support].numpy(), (expected[support] * total).numpy())
    assert p_value > 1e-4, f"chi-square rejects the target distribution (p={p_value:.2e})"


def _dist(logits: list[float]) -> torch.Tensor:
    return torch.tensor(logits, dtype=torch.float64).softmax(-1)


CASES = {
    "p_close_to_q": (
        torch.stack([_dist([1.0, 0.5, 0.2, 0.0, -0.3, -1, 0.8, 0.1]), _dist([0.2, 1.1, 0.0, 0.4, 0.3, -2, 0, 0.5]),
                     _dist([0.0] * 8)]),
        torch.stack([_dist([1.1, 0.4, 0.2, 0.1, -0.3, -1, 0.7, 0.1]), _dist([0.3, 1.0, 0.1, 0.4, 0.2, -2, 0, 0.4])]),
    ),
    "disjoint_supports": (
        torch.tensor([[0.4, 0.3, 0.2, 0.1, 0, 0, 0, 0], [0.1, 0.2, 0.3, 0.4, 0, 0, 0, 0], [0.25] * 4 + [0] * 4],
                     dtype=torch.float64),
        torch.tensor([[0, 0, 0, 0, 0.25, 0.25, 0.25, 0.25], [0, 0, 0, 0, 0.1, 0.2, 0.3, 0.4]], dtype=torch.float64),
    ),
    "one_hot_draft": (
        torch.stack([_dist([0.3, 1.2, 0.0, -0.5, 0.7, 0.1, 0.0, -1.0])] * 3),
        torch.tensor([[0, 1.0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 1.0, 0, 0, 0]], dtype=torch.float64),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_output_follows_target(case: str) -> None:
    p, q = CASES[case]
    accepted, first, second = _run_block(p, q, top_m=VOCAB, seed=7)
    _assert_matches(first, p[0])
    if case == "disjoint_supports":
        assert accepted.sum() == 0
    else:
        assert (accepted > 0).sum() > TRIALS // 10
        _assert_matches(second[accepted > 0], p[1])


def test_truncated_draft_and_top_k_top_p_processing_stay_exact() -> None:
    gen = torch.Generator().manual_seed(3)
    target_logits = torch.randn(3, VOCAB, generator=gen) * 1.5
    draft_logits = target_logits[:2] + torch.randn(2, VOCAB, generator=gen)
    params = SamplingParams(temperature=0.7, top_k=6, top_p=0.85)
    p, q = processed_probs(target_logits, params), processed_probs(draft_logits, params)
    assert (p > 0).sum(-1).max() <= 6 and (q > 0).sum(-1).max() <= 6
    accepted, first, second = _run_block(p, q, top_m=3, seed=11)
    _assert_matches(first, p[0])
    _assert_matches(second[accepted > 0], p[1])


def test_processing_matches_reference_top_k_top_p() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 3.0]])
    probs = processed_probs(logits, SamplingParams(temperature=1.0, top_k=4, top_p=0.9))
    reference = torch.softmax(logits[0].double(), -1)
    keep = [5, 0, 1]  # top-4 is {5, 0, 1, 2}; the nucleus of mass 0.9 among them stops after three tokens
    expected = torch.zeros(6, dtype=torch.float64)
    top4 = torch.softmax(logits[0, [5, 0, 1, 2]].double(), -1)
    assert top4[:2].sum() < 0.9 <= top4[:3].sum()
    expected[keep] = reference[keep] / reference[keep].sum()
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs[0].double(), expected)


def test_min_p_drops_what_is_far_below_the_top_token_before_top_p() -> None:
    """vLLM's order: temperature, then min-p on the scaled distribution, then top-k and top-p on what is left."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 3.0]])  # at temperature 0.5: 4, 2, 1, 0, -2, 6
    scaled = torch.softmax(logits[0].double() / 0.5, -1)
    kept = scaled >= 0.01 * scaled.max()
    assert kept.nonzero().flatten().tolist() == [0, 1, 5]  # e^(x - 6) >= 0.01 for x = 4, 2, 6

    def expected(ids: list[int]) -> torch.Tensor:
        out = torch.zeros(6, dtype=torch.float64)
        out[ids] = scaled[ids] / scaled[ids].sum()
        return out

    alone = processed_probs(logits, SamplingParams(temperature=0.5, min_p=0.01))
    torch.testing.assert_close(alone[0].double(), expected([0, 1, 5]))
    # top-p 0.9 over the survivors {6: 0.867, 4: 0.117, 2: 0.016}: the third is past the nucleus.
    with_top_p = processed_probs(logits, SamplingParams(temperature=0.5, min_p=0.01, top_p=0.9))
    torch.testing.assert_close(with_top_p[0].double(), expected([0, 5]))
    greedy = processed_probs(logits, SamplingParams(temperature=0.0, min_p=0.5))
    assert greedy[0].tolist() == [0, 0, 0, 0, 0, 1]


def test_greedy_accepts_matching_prefix_then_corrects() -> None:
    assert accept_greedy(torch.tensor([4, 5, 6]), torch.tensor([4, 5, 9, 1])) == (2, 9)
    assert accept_greedy(torch.tensor([4, 5, 6]), torch.tensor([4, 5, 6, 1])) == (3, 1)
    assert accept_greedy(torch.tensor([], dtype=torch.long), torch.tensor([7])) == (0, 7)


def test_bonus_token_follows_the_distribution_after_the_block() -> None:
    """q equal to p accepts every draft, so the emitted token is always the bonus: it must follow p_{k+1}."""
    generator = torch.Generator().manual_seed(5)
    p = torch.stack([_dist([1.0, 0.5, 0.2, 0.0, -0.3, -1, 0.8, 0.1]), _dist([0.2, 1.1, 0.0, 0.4, 0.3, -2, 0, 0.5]),
                     _dist([-1.0, 0.0, 2.0, 0.3, 0.3, 1.0, -2, 0.0])])
    k = 2
    draft_tokens = torch.stack([torch.multinomial(p[i], TRIALS, replacement=True, generator=generator)
                                for i in range(k)], dim=1)
    full = SparseDist(ids=torch.arange(VOCAB).expand(TRIALS, k, -1), probs=p[:k].expand(TRIALS, -1, -1))
    accepted, next_token = accept_sampled(
        draft_tokens, full, p.expand(TRIALS, -1, -1),
        torch.rand(TRIALS, k, generator=generator, dtype=torch.float64),
        torch.rand(TRIALS, k + 1, generator=generator, dtype=torch.float64),
    )
    assert (accepted == k).all()
    _assert_matches(next_token, p[k])
