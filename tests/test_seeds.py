"""Seeds that reproduce: a seeded request gives the tokens plain decoding gives with that seed, whatever the draft,
k, batch mates or lost worker state; random numbers are keyed by (seed, token position), never by call order."""

from __future__ import annotations

import pytest
import torch

from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.core.sampling import (
    ACCEPT_STREAM,
    DRAFT_STREAM,
    gumbel_choice,
    gumbel_noise,
    keyed_uniforms,
    processed_probs,
)
from tandem.engines.local import build_engine

PROMPTS = [[72, 101, 108, 108, 111, 44, 32, 119], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [97, 98, 99]]


def _sampled(seed: int | None, max_tokens: int = 40, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_tokens=max_tokens, ignore_eos=True, **kw)


def _fixed(k: int) -> EngineConfig:
    return EngineConfig(spec=SpecConfig(adaptive=False, k_max=k, k_init=k), calibrate=False)


def test_keyed_numbers_depend_on_seed_position_and_stream_only() -> None:
    first = keyed_uniforms(7, range(100, 110), ACCEPT_STREAM)
    assert torch.equal(first, keyed_uniforms(7, range(100, 110), ACCEPT_STREAM))
    assert torch.equal(first[3:5], keyed_uniforms(7, [103, 104], ACCEPT_STREAM))  # no dependence on call shape
    assert not torch.equal(first, keyed_uniforms(8, range(100, 110), ACCEPT_STREAM))
    assert not torch.equal(first, keyed_uniforms(7, range(100, 110), DRAFT_STREAM))
    assert len(set(first.tolist())) == 10 and ((first >= 0) & (first < 1)).all()
    assert torch.equal(gumbel_noise(3, 5, 64), gumbel_noise(3, 5, 64))
    assert not torch.equal(gumbel_noise(3, 5, 64), gumbel_noise(3, 6, 64))


def test_gumbel_choice_samples_the_processed_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    params = SamplingParams(temperature=0.7, top_k=4, seed=0)
    probs = processed_probs(logits, params)
    picks = torch.tensor([int(gumbel_choice(probs, s, 0)[0]) for s in range(20000)])
    counts = torch.bincount(picks, minlength=6).double() / len(picks)
    expected = torch.softmax(torch.tensor([2.0, 1.0, 0.5, 0.0]) / 0.7, -1).double()
    assert counts[4:].sum() == 0  # top-k cut
    assert (counts[:4] - expected).abs().max() < 0.015


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 11])
def test_seeded_tokens_are_plain_decodings_whatever_the_speculation(tiny_models, seed: int) -> None:
    target, draft, draft_random = tiny_models
    params = _sampled(seed)
    plain = build_engine(target, None, EngineConfig(calibrate=False)).generate(PROMPTS, params)
    expected = [r.token_ids for r in plain]
    assert len(set(map(tuple, expected))) == len(PROMPTS)
    runs = {
        "k2": build_engine(target, draft, _fixed(2)),
        "k6": build_engine(target, draft, _fixed(6)),
        "auto": build_engine(target, draft, EngineConfig(calibrate=False)),
        "random draft": build_engine(target, draft_random, _fixed(4)),
    }
    for name, engine in runs.items():
        results = engine.generate(PROMPTS, params)
        assert [r.token_ids for r in results] == expected, name
    spec = build_engine(target, draft, _fixed(4))
    drafted = spec.generate(PROMPTS, params)
    assert sum(r.stats["accepted"] for r in drafted) > 0  # the draft's seeded choices do get accepted
    alone = [build_engine(target, draft, _fixed(3)).generate([p], params)[0].token_ids for p in PROMPTS]
    assert alone == expected  # batch mates change nothing


def test_seeded_drafts_are_accepted_at_a_useful_rate(tiny_models) -> None:
    """The good tiny draft agrees with the target's seeded choices often, the unrelated one rarely."""
    target, draft, draft_random = tiny_models
    rates = {}
    for name, model in (("good", draft), ("random", draft_random)):
        results = build_engine(target, model, _fixed(4)).generate(PROMPTS, _sampled(5, max_tokens=60))
        rates[name] = sum(r.stats["accepted"] for r in results) / sum(r.stats["drafted"] for r in results)
    assert rates["good"] > 0.3 and rates["good"] > 2 * rates["random"], rates


def test_unseeded_requests_get_one_engine_seed_for_every_worker(tiny_models) -> None:
    target, draft, _ = tiny_models
    engine = build_engine(target, draft, _fixed(3))
    ids = [engine.add_request(PROMPTS[0], _sampled(None)) for _ in range(2)]
    seeds = [engine.sequences[i].params.engine_seed for i in ids]
    assert all(isinstance(s, int) for s in seeds) and seeds[0] != seeds[1]
    greedy = engine.add_request(PROMPTS[0], SamplingParams(temperature=0.0))
    assert engine.sequences[greedy].params.engine_seed is None
    # The engine's seed keys the numbers: the same engine_seed gives the same tokens with speculation on or off.
    fixed = _sampled(None, engine_seed=1234)
    plain = build_engine(target, None, EngineConfig(calibrate=False)).generate([PROMPTS[1]], fixed)[0]
    again = build_engine(target, None, EngineConfig(calibrate=False)).generate([PROMPTS[1]], fixed)[0]
    assert plain.token_ids == again.token_ids


@pytest.mark.parametrize("seeded", [True, False])
def test_lost_worker_state_reuses_no_random_numbers(tiny_models, seeded: bool) -> None:
    """A worker that loses a sequence mid-generation gets its history again; the tokens after the loss are the
    ones an undisturbed run gives, because numbers are keyed by position (a rebuilt generator would replay them)."""
    target, draft, _ = tiny_models
    params = _sampled(21) if seeded else _sampled(None, engine_seed=21)
    undisturbed = build_engine(target, draft, _fixed(3)).generate([PROMPTS[0]], params)[0].token_ids
    engine = build_engine(target, draft, _fixed(3))
    seq = engine.sequences[engine.add_request(PROMPTS[0], params)]
    for step in range(12):
        engine.step()
        if step in (3, 7):
            assert engine.has_unfinished(), "finished before the workers lost it; lengthen the request"
            engine.verifier.release(seq.request_id)
            engine.drafter.release(seq.request_id)
    while engine.has_unfinished():
        engine.step()
    assert engine.result(seq).token_ids == undisturbed
