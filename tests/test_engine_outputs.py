"""What the whole engine emits: stops (a stop token inside an accepted block, EOS unless ignored, a stop string cut
exactly, max_tokens exactly), greedy decoding at a temperature too small to divide by, a rollback's fresh logits,
batched rows matching single ones, a retried call staying exact, and sampled output that is seeded reproducibly and
follows the target's distribution."""

from __future__ import annotations

import pytest
import torch

from engine_harness import (  # the fixture by its name: plain_output
    FIXED_K,
    PROMPT,
    _greedy,
    plain_output_fixture,  # noqa: F401
)
from marginals import assert_second_tokens_follow
from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.core.runner import ModelRunner
from tandem.engines.local import build_engine


def test_stop_token_inside_an_accepted_block_ends_output_there(tiny_models, plain_output) -> None:
    target, draft, _ = tiny_models
    stop_at = next(i for i in range(12, 40) if plain_output[i] not in plain_output[:i])
    result = build_engine(target, draft, FIXED_K).generate(
        [PROMPT], _greedy(stop_token_ids=(plain_output[stop_at],)))[0]
    assert result.token_ids == plain_output[:stop_at]
    assert result.finish_reason == "stop"


@pytest.mark.parametrize("seed", [None, 7])
def test_a_temperature_too_small_to_divide_by_samples_greedily(tiny_models, plain_output, seed) -> None:
    """Logits divided by 1e-38 overflow float32 (softmax of inf: NaN); below GREEDY_BELOW the choice is the argmax, as
    vLLM's is, drafted or not, seeded or not."""
    target, draft, _ = tiny_models
    tiny = SamplingParams(temperature=1e-38, max_tokens=48, ignore_eos=True, seed=seed)
    assert tiny.greedy and not SamplingParams(temperature=1e-4).greedy
    for engine in (build_engine(target, None), build_engine(target, draft, FIXED_K)):
        assert engine.generate([PROMPT], tiny)[0].token_ids == plain_output


def test_eos_stops_unless_ignored(tiny_models, plain_output) -> None:
    target, draft, _ = tiny_models
    engine = build_engine(target, draft, FIXED_K)
    stop_at = next(i for i in range(5, 40) if plain_output[i] not in plain_output[:i])
    engine.eos_token_ids = frozenset({plain_output[stop_at]})
    params = SamplingParams(temperature=0.0, max_tokens=48)
    assert engine.generate([PROMPT], params)[0].token_ids == plain_output[:stop_at]
    assert engine.generate([PROMPT], _greedy())[0].token_ids == plain_output


def test_stop_string_cuts_text_exactly(tiny_models, plain_output) -> None:
    target, draft, _ = tiny_models
    engine = build_engine(target, draft, FIXED_K)
    full_text = engine.decode(plain_output)
    stop = full_text[20:23]
    cut = full_text.find(stop)
    result = engine.generate([PROMPT], _greedy(stop=(stop,)))[0]
    assert result.text == full_text[:cut] and result.finish_reason == "stop"
    assert result.token_ids == plain_output[: len(result.token_ids)]
    assert stop in engine.decode(result.token_ids)
    assert stop not in engine.decode(result.token_ids[:-1])


def test_max_tokens_is_exact(tiny_models, plain_output) -> None:
    target, draft, _ = tiny_models
    for n in (1, 2, 5, 17):
        result = build_engine(target, draft, FIXED_K).generate([PROMPT], _greedy(max_tokens=n))[0]
        assert result.token_ids == plain_output[:n] and result.finish_reason == "length"


def test_rollback_then_new_tokens_gives_fresh_logits(tiny_models) -> None:
    runner = ModelRunner(tiny_models[0].model)
    state = runner.state("a")
    state.sync(0, PROMPT + [1, 2, 3])
    runner.forward([state], [1])
    state.sync(len(PROMPT), [9, 8])
    assert state.cached == len(PROMPT)
    rolled = runner.forward([state], [2])[0]
    fresh_state = runner.state("b")
    fresh_state.sync(0, PROMPT + [9, 8])
    fresh = runner.forward([fresh_state], [2])[0]
    torch.testing.assert_close(rolled, fresh, rtol=1e-4, atol=1e-4)


def test_batched_forward_matches_single_rows(tiny_models) -> None:
    runner = ModelRunner(tiny_models[0].model)
    rows = [PROMPT[:3], PROMPT, PROMPT[:1] + [5, 6, 7, 8, 9, 10, 11, 12, 13]]
    states = []
    for i, tokens in enumerate(rows):
        state = runner.state(f"b{i}")
        state.sync(0, tokens)
        runner.prefill(state, len(tokens) - 2)
        state.sync(len(tokens), [i + 3, 4])
        states.append(state)
    wants = [1, 3, 2]
    batched = runner.forward(states, wants)
    for i, (tokens, want) in enumerate(zip(rows, wants, strict=True)):
        alone = runner.state(f"s{i}")
        alone.sync(0, tokens + [i + 3, 4])
        torch.testing.assert_close(batched[i], runner.forward([alone], [want])[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("seeded", "top_m", "min_p"), [(True, 64, 0.0), (False, 64, 0.0), (False, 2, 0.0),
                                                        (False, 64, 0.05)],
                         ids=["client-seeded-gumbel", "engine-seeded-min-p-over-q", "draft-truncated-to-top-2",
                              "min-p-filter"])
def test_sampled_output_follows_target_distribution(tiny_models, seeded: bool, top_m: int, min_p: float) -> None:
    """Second-token marginal over 3000 runs equals sum_t p(t) p(. | t) computed from the target, under both rules:
    clients' seeds (drafter-invariant Gumbel-max) and seeds the engine picks (min(1, p/q) acceptance), also with
    drafts truncated to their top 2 tokens (the drafter must report the truncated q it sampled from) and with a
    min-p filter."""
    target, draft, _ = tiny_models
    params = [SamplingParams(temperature=0.9, top_k=12, top_p=0.95, min_p=min_p, seed=s if seeded else None,
                             max_tokens=2, ignore_eos=True) for s in range(3000)]
    engine = build_engine(target, draft, EngineConfig(spec=SpecConfig(adaptive=False, k_init=2, draft_top_m=top_m),
                                                      max_batch=500, calibrate=False))
    results = engine.generate([PROMPT] * len(params), params)
    assert sum(r.stats["accepted"] for r in results) > 1000
    from tandem.core.sampling import processed_probs

    with torch.inference_mode():
        p_first = processed_probs(target.model(torch.tensor([PROMPT])).logits[0, -1:], params[0])[0]
        support = p_first.nonzero().flatten()
        batch = torch.tensor([PROMPT + [int(t)] for t in support])
        p_second = processed_probs(target.model(batch).logits[:, -1], params[0])
    assert_second_tokens_follow(results, p_first, support.tolist(), p_second)


def test_seeded_sampling_is_reproducible(tiny_models) -> None:
    target, draft, _ = tiny_models
    params = SamplingParams(temperature=1.0, seed=42, max_tokens=30, ignore_eos=True)
    first = build_engine(target, draft, FIXED_K).generate([PROMPT], params)[0].token_ids
    assert build_engine(target, draft, FIXED_K).generate([PROMPT], params)[0].token_ids == first


def test_a_retried_call_after_partial_success_stays_exact(tiny_models, plain_output) -> None:
    """A worker that already applied a round and is sent it again rolls back and recomputes the same result."""
    target, draft, _ = tiny_models
    engine = build_engine(target, draft, FIXED_K)
    request_id = engine.add_request(PROMPT, _greedy())
    seq = engine.sequences[request_id]
    verify = engine.verifier.verify

    def verify_twice(requests):
        verify([type(r)(r.seq_id, r.keep, list(r.append), r.draft, r.params) for r in requests])
        return verify(requests)

    engine.verifier.verify = verify_twice
    while engine.has_unfinished():
        engine.step()
    assert seq.output == plain_output
