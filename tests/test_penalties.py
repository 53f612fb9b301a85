"""Penalties and logit bias: equal to independent references, lossless through speculation, batched with rows that
have none."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from marginals import assert_second_tokens_follow
from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.core.penalties import reshaped_logits
from tandem.engines.local import build_engine
from tandem.errors import InvalidArgument

pytestmark = pytest.mark.xdist_group("penalties")
NEW_TOKENS = 32
FIXED_K = EngineConfig(spec=SpecConfig(adaptive=False, k_init=4), calibrate=False)
OUTPUT = {"frequency_penalty": 0.7, "presence_penalty": 0.5}


def _prompts(vocab: int, count: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(77)
    lengths = torch.randint(2, 30, (count,), generator=generator)
    return [torch.randint(0, vocab, (int(n),), generator=generator).tolist() for n in lengths]


def _favoured_prompts(target, count: int) -> list[list[int]]:
    """Random prompts, each followed by the first 12 tokens the model greedily goes on with: tokens it favours sit in
    the prompt, where frequency and presence penalties must not count them."""
    prompts = _prompts(len(target.tokenizer), count)
    plain = build_engine(target, None).generate(prompts, _greedy())
    return [prompt + result.token_ids[:12] for prompt, result in zip(prompts, plain, strict=True)]


def _naive(logits: torch.Tensor, params: SamplingParams, history: list[int], output_start: int) -> torch.Tensor:
    """One position's [V] logits reshaped token by token, as the fields are documented (bias, then the repetition
    penalty over the whole history, then frequency and presence over the output): shares no code with
    core.penalties."""
    out = logits.clone().float()
    vocab = out.shape[0]
    for token, bias in params.logit_bias:
        if token < vocab:
            out[token] += bias
    if params.repetition_penalty != 1.0:
        for token in set(history):
            if token < vocab:
                value = out[token]
                out[token] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
    for token, count in Counter(history[output_start:]).items():
        if token < vocab:
            out[token] -= params.frequency_penalty * count + params.presence_penalty
    return out


def _greedy(**fields) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, **fields)


def test_reshaped_positions_count_the_drafts_before_them() -> None:
    """Each of the k + 1 verified positions, against the naive reference over context + drafts[:i]; ids past the
    scored vocabulary (a draft scoring a prefix of it) are left out."""
    generator = torch.Generator().manual_seed(5)
    vocab = 40
    logits = torch.randn(5, vocab, generator=generator) * 4
    context = [3, 7, 7, 12, 39, 55, 3, 21]  # 55 lies past the scored vocabulary
    drafts = [21, 7, 60, 21]
    params = SamplingParams(repetition_penalty=1.4, frequency_penalty=0.6, presence_penalty=-0.3,
                            logit_bias=((2, 5.0), (7, -1.5), (99, 3.0)))
    reshaped = reshaped_logits(logits, params, context, 4, drafts)
    for i in range(5):
        expected = _naive(logits[i], params, context + drafts[:i], 4)
        torch.testing.assert_close(reshaped[i], expected, rtol=0, atol=1e-5)
    assert reshaped.data_ptr() != logits.data_ptr()


@pytest.mark.parametrize(("fields", "match"), [
    ({"repetition_penalty": 0.0}, "^repetition_penalty:"), ({"presence_penalty": 2.5}, "^presence_penalty:"),
    ({"frequency_penalty": -3}, "^frequency_penalty:"), ({"logit_bias": ((1, 101.0),)}, "^logit_bias:"),
    ({"logit_bias": ((-1, 1.0),)}, "^logit_bias:"), ({"logit_bias": ((1, 1.0), (1, 2.0))}, "^logit_bias:"),
    ({"logit_bias": tuple((i, 1.0) for i in range(1025))}, "^logit_bias: at most 1024"),
    # as the wire's float32 fields bring them (2.1 arrives as 2.0999999046325684), shown as the client wrote them
    ({"presence_penalty": 2.0999999046325684}, r"^presence_penalty: must be between -2 and 2, got 2\.1$"),
    ({"temperature": -0.10000000149011612}, r"^temperature: must be between 0 and 100, got -0\.1$"),
])
def test_bad_penalties_name_the_field(fields: dict, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        SamplingParams(**fields)


def test_a_bias_outside_the_vocabulary_is_refused(tiny_models) -> None:
    engine = build_engine(tiny_models[0], None)
    with pytest.raises(InvalidArgument, match=r"^logit_bias: \[.*\] are outside the vocabulary"):
        engine.add_request([1, 2, 3], _greedy(logit_bias=((10**6, 1.0),)))


def test_greedy_repetition_penalty_equals_hugging_face_generate(tiny_models) -> None:
    """Hugging Face's RepetitionPenaltyLogitsProcessor, through its own generate, against speculation (k 4, batches
    of 4) and plain decoding."""
    target, draft, _ = tiny_models
    prompts = _prompts(len(target.tokenizer), 8)
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0,
                                    repetition_penalty=1.3, temperature=None, top_p=None, top_k=None)
        expected.append(out[0, len(prompt) :].tolist())
    params = _greedy(repetition_penalty=1.3)
    speculative = build_engine(target, draft, FIXED_K)
    outputs = [r.token_ids for start in range(0, len(prompts), 4)
               for r in speculative.generate(prompts[start : start + 4], params)]
    assert outputs == expected
    assert [r.token_ids for r in build_engine(target, None).generate(prompts, params)] == expected
    unpenalized = [r.token_ids for r in build_engine(target, None).generate(prompts, _greedy())]
    assert unpenalized != expected  # the penalty changed something: the comparison has teeth


def test_greedy_output_penalties_and_bias_equal_a_step_by_step_reference(tiny_models) -> None:
    """Frequency and presence penalties over the output and a logit bias, the reference recomputing every step from
    the whole sequence; speculated in one batch with rows that have none (no reshaping leaks across rows)."""
    target, draft, _ = tiny_models
    prompts = _favoured_prompts(target, 6)
    plain_first = build_engine(target, None).generate(prompts[:1], _greedy())[0].token_ids
    bias = tuple(sorted({(plain_first[0], -100.0), (plain_first[3], 4.0), (5, 2.5)}))
    penalized = [_greedy(**OUTPUT, logit_bias=bias), _greedy(**OUTPUT), _greedy(), _greedy(logit_bias=bias),
                 _greedy(frequency_penalty=-0.8), _greedy()]
    expected = []
    with torch.inference_mode():
        for prompt, params in zip(prompts, penalized, strict=True):
            sequence = list(prompt)
            for _ in range(NEW_TOKENS):
                logits = target.model(torch.tensor([sequence])).logits[0, -1]
                sequence.append(int(_naive(logits, params, sequence, len(prompt)).argmax()))
            expected.append(sequence[len(prompt) :])
    results = build_engine(target, draft, FIXED_K).generate(prompts, penalized)
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats["accepted"] for r in results) > 0
    assert [r.token_ids for r in build_engine(target, None).generate(prompts, penalized)] == expected
    assert expected[0][0] != plain_first[0]  # the banned token is gone


def test_a_draft_that_is_the_target_is_always_accepted_under_penalties(tiny_models) -> None:
    """With the target as its own draft every drafted token is accepted, but only if the drafter reshapes its logits
    exactly as the verifier does, its earlier drafts counted."""
    target = tiny_models[0]
    prompts = _favoured_prompts(target, 4)
    # Apart: a repetition penalty over the whole context would mask a drafter counting the prompt as output.
    for params in (_greedy(repetition_penalty=1.5, logit_bias=((5, 3.0), (9, -2.0))), _greedy(**OUTPUT)):
        results = build_engine(target, target, FIXED_K).generate(prompts, params)
        assert all(r.stats["drafted"] > 0 and r.stats["accepted"] == r.stats["drafted"] for r in results)


def test_seeded_penalized_tokens_are_the_same_with_speculation_on_and_off(tiny_models) -> None:
    target, draft, _ = tiny_models
    prompts = _prompts(len(target.tokenizer), 6)
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=300 + i, max_tokens=NEW_TOKENS, ignore_eos=True,
                             repetition_penalty=1.2, **OUTPUT) for i in range(len(prompts))]
    plain = [r.token_ids for r in build_engine(target, None).generate(prompts, params)]
    for k in (2, 6):
        config = EngineConfig(spec=SpecConfig(adaptive=False, k_init=k), calibrate=False)
        assert [r.token_ids for r in build_engine(target, draft, config).generate(prompts, params)] == plain


@pytest.mark.parametrize("seeded", [False, True], ids=["min-p-over-q", "client-seeded-gumbel"])
def test_sampled_penalized_output_follows_the_target_distribution(tiny_models, seeded: bool) -> None:
    """Second-token marginal over 3000 runs against sum_t p(t) p(. | t), each computed from the target with the
    naive reference (the second position's penalties count the first token)."""
    target, draft, _ = tiny_models
    prompt = [72, 101, 108, 108, 111, 44, 32, 119]
    params = [SamplingParams(temperature=0.9, top_k=12, seed=s if seeded else None, max_tokens=2, ignore_eos=True,
                             repetition_penalty=1.3, frequency_penalty=1.5, presence_penalty=0.5)
              for s in range(3000)]
    engine = build_engine(target, draft, EngineConfig(spec=SpecConfig(adaptive=False, k_init=2), max_batch=500,
                                                      calibrate=False))
    results = engine.generate([prompt] * len(params), params)
    assert sum(r.stats["accepted"] for r in results) > 1000

    def probs(logits: torch.Tensor, history: list[int]) -> torch.Tensor:
        scaled = _naive(logits, params[0], history, len(prompt)) / params[0].temperature
        kth = scaled.topk(params[0].top_k).values[-1]
        return scaled.masked_fill(scaled < kth, float("-inf")).softmax(-1)

    with torch.inference_mode():
        p_first = probs(target.model(torch.tensor([prompt])).logits[0, -1], prompt)
        support = p_first.nonzero().flatten().tolist()
        last = target.model(torch.tensor([prompt + [t] for t in support])).logits[:, -1]
        p_second = torch.stack([probs(last[i], prompt + [t]) for i, t in enumerate(support)])
    assert_second_tokens_follow(results, p_first, support, p_second)
