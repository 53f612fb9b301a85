"""Prompt logprobs (SamplingParams.prompt_logprobs): every prompt token after the first scored by the target in the
forward of the sequence's first round, exactly as a plain forward over the prompt gives them, whatever else the
engine does meanwhile (speculation, batch mates, chunked prefill, a session's retained cache, Ray workers)."""

from __future__ import annotations

import pytest

from tandem.core.config import EngineConfig, SamplingParams
from tandem.core.engine import SpeculativeEngine
from tandem.core.local import LocalDrafter
from tandem.core.runner import ModelRunner
from tandem.engines.local import build_engine
from tandem.errors import InvalidArgument
from test_logprobs import PROMPTS, _assert_matches, _engine, _fixed, _greedy, _reference, _sampled


def _assert_prompt_scored(target, prompt: list[int], result, top: int) -> None:
    """Position i of the prompt scores token i + 1: the reference is a plain forward over the prompt; each token's
    rank is its place in the reference's row (up to rounding between near ties)."""
    _assert_matches(target, prompt[:1], prompt[1:], result.prompt_logprobs, top)
    reference = _reference(target, prompt[:1], prompt[1:])
    for entry, row in zip(result.prompt_logprobs, reference, strict=True):
        value = float(row[entry.token_id])
        assert int((row > value + 1e-4).sum()) + 1 <= entry.rank <= int((row > value - 1e-4).sum())  # counts itself


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_tokens_are_scored_as_a_plain_forward_scores_them(tiny_models, k: int) -> None:
    """Rows of different lengths asking different widths, beside a row that does not ask; outputs unchanged."""
    target = tiny_models[0]
    params = [_greedy(prompt_logprobs=5), _greedy(), _sampled(3, prompt_logprobs=0, logprobs=2)]
    results = _engine(tiny_models, k).generate(PROMPTS, params)
    _assert_prompt_scored(target, PROMPTS[0], results[0], 5)
    assert results[1].prompt_logprobs is None
    _assert_prompt_scored(target, PROMPTS[2], results[2], 0)
    _assert_matches(target, PROMPTS[2], results[2].token_ids, results[2].logprobs, 2)
    plain = _engine(tiny_models, k).generate(PROMPTS, [_greedy(), _greedy(), _sampled(3, logprobs=2)])
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]


def test_a_one_token_prompt_has_nothing_to_score(tiny_models) -> None:
    result = _engine(tiny_models, 3).generate([[42]], _greedy(prompt_logprobs=2))[0]
    assert result.prompt_logprobs == [] and len(result.token_ids) == 24


def test_the_prompt_is_scored_whole_while_others_decode_and_prefill_in_chunks(tiny_models) -> None:
    """A long prompt arriving while another sequence decodes is prefilled in chunks, unless it asks to be scored:
    then it goes whole into its first round's forward. Both get plain decoding's tokens."""
    target, draft, _ = tiny_models
    engine = build_engine(target, draft, EngineConfig(spec=_fixed(3).spec, calibrate=False, prefill_chunk=8))
    long_prompt = [(7 * i) % 250 + 3 for i in range(60)]
    decoding = engine.add_request(PROMPTS[0], _greedy(max_tokens=40))
    for _ in range(3):
        engine.step()
    scored = engine.add_request(long_prompt, _greedy(prompt_logprobs=3))
    chunked = engine.add_request(long_prompt[::-1], _greedy())
    outputs: dict[str, list] = {decoding: [], scored: [], chunked: []}
    first: dict[str, object] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
            first.setdefault(out.request_id, out)
    assert first[chunked].prompt_logprobs is None
    _assert_prompt_scored(target, long_prompt, first[scored], 3)
    assert all(out.prompt_logprobs is None for out in outputs[scored][1:])  # once, in the first output
    expected = _engine(tiny_models, 0).generate([long_prompt, long_prompt[::-1]], _greedy())
    assert [[t for out in outputs[i] for t in out.new_token_ids] for i in (scored, chunked)] == \
        [r.token_ids for r in expected]


def test_a_sessions_retained_cache_is_not_taken_for_a_scored_prompt(tiny_models) -> None:
    """A session's next request reuses its retained cache, but one that asks for its prompt scored is scored whole,
    and says it found nothing cached (usage's cached tokens: none of the prompt was served from a cache)."""
    target = tiny_models[0]
    engine = _engine(tiny_models, 3)
    reused = engine.verifier.runner.reused_tokens
    first = engine.generate([PROMPTS[1]], _greedy(max_tokens=8))[0]
    engine.add_request(PROMPTS[1], _greedy(max_tokens=8), session_id="s")
    while engine.has_unfinished():
        engine.step()
    follow_up = PROMPTS[1] + first.token_ids + [60, 61, 62]
    request_id = engine.add_request(follow_up, _greedy(max_tokens=8, prompt_logprobs=1), session_id="s")
    while engine.has_unfinished():
        outputs = engine.step()
        result = next((out for out in outputs if out.request_id == request_id and out.prompt_logprobs), None)
        if result is not None:
            break
    _assert_prompt_scored(target, follow_up, result, 1)
    assert engine.sequences[request_id].stats.cached_prompt_tokens == 0
    assert engine.verifier.runner.reused_tokens == reused


def test_prompt_logprobs_are_bounded_like_logprobs() -> None:
    with pytest.raises(InvalidArgument, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


def test_prompt_logprobs_travel_through_ray_target_workers(tiny_models, tiny_dirs, ray_session) -> None:
    from tandem.workers.target_pool import RayVerifier, start_target_replicas
    from tandem.workers.worker_base import WorkerConfig

    target, draft, _ = tiny_models
    replicas = start_target_replicas(WorkerConfig(model=str(tiny_dirs.target), dtype="float32", threads=1), count=1)
    try:
        engine = SpeculativeEngine(RayVerifier(replicas), LocalDrafter(ModelRunner(draft.model)), _fixed(3))
        results = engine.generate(PROMPTS, [_greedy(prompt_logprobs=4), _greedy(), _greedy(prompt_logprobs=0)])
    finally:
        for replica in replicas:
            ray_session.kill(replica)
    _assert_prompt_scored(target, PROMPTS[0], results[0], 4)
    assert results[1].prompt_logprobs is None
    _assert_prompt_scored(target, PROMPTS[2], results[2], 0)


def test_a_prompt_longer_than_one_part_is_scored_part_by_part(tiny_models, monkeypatch) -> None:
    """Logits are made a part of the prompt at a time: parts of 4 positions give what one part gives."""
    from tandem.core import prompt_logprobs

    monkeypatch.setattr(prompt_logprobs, "ROWS_AT_ONCE", 4)
    results = _engine(tiny_models, 3).generate(PROMPTS, [_greedy(prompt_logprobs=2)] * 3)
    for prompt, result in zip(PROMPTS, results, strict=True):
        _assert_prompt_scored(tiny_models[0], prompt, result, 2)
