"""Logprobs of emitted tokens are the target's own: log-softmax of its raw logits at the position that produced each
token, whether the token was an accepted draft, a resampled token or a bonus token, and whatever the sampling."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.core.engine import SpeculativeEngine
from tandem.core.local import LocalVerifier
from tandem.core.logprobs import TokenLogprob
from tandem.core.protocol import VerifyRequest
from tandem.core.runner import ModelRunner
from tandem.engines.local import build_engine

PROMPTS = [[72, 101, 108, 108, 111, 44, 32, 119], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [97, 98, 99]]
ATOL = 1e-4


def _fixed(k: int) -> EngineConfig:
    return EngineConfig(spec=SpecConfig(adaptive=False, k_max=max(k, 1), k_init=k), calibrate=False)


def _engine(tiny_models, k: int) -> SpeculativeEngine:
    """k 0: plain decoding, no drafter at all."""
    target, draft, _ = tiny_models
    return build_engine(target, draft if k else None, _fixed(k) if k else EngineConfig(calibrate=False))


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=kw.pop("max_tokens", 24), ignore_eos=True, **kw)


def _sampled(seed: int | None, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.9, seed=seed, max_tokens=24, ignore_eos=True, **kw)


def _reference(target, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V]: a plain Hugging Face forward over prompt + output (no cache, no masks of ours); row i is
    the log-softmax of the raw logits at the position that produced output[i]."""
    with torch.inference_mode():
        logits = target.model(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : len(prompt) - 1 + len(output)]


def _assert_matches(target, prompt: list[int], output: list[int], logprobs: list[TokenLogprob] | None,
                    top: int) -> None:
    assert logprobs is not None and len(logprobs) == len(output)
    reference = _reference(target, prompt, output)
    for i, (token, entry, row) in enumerate(zip(output, logprobs, reference, strict=True)):
        assert entry.token_id == token, f"token {i}"
        assert entry.logprob == pytest.approx(float(row[token]), abs=ATOL), f"token {i}"
        assert len(entry.top) == top
        if not top:
            continue
        expected = torch.topk(row, top)
        ids = [t for t, _ in entry.top]
        values = torch.tensor([v for _, v in entry.top])
        # The top values are the reference's; the ids carry them (robust to a near-tie swapping places).
        assert torch.allclose(values, expected.values, atol=ATOL), f"token {i}"
        assert torch.allclose(row[ids], values, atol=ATOL), f"token {i}"
        assert ids == expected.indices.tolist() or (expected.values.diff().abs() < ATOL).any()


@pytest.mark.parametrize("k", [0, 2, 4])
def test_greedy_logprobs_are_the_targets_at_each_position(tiny_models, k: int) -> None:
    target = tiny_models[0]
    engine = _engine(tiny_models, k)
    results = engine.generate(PROMPTS, _greedy(logprobs=5))
    for prompt, result in zip(PROMPTS, results, strict=True):
        _assert_matches(target, prompt, result.token_ids, result.logprobs, 5)
        # Greedy: the emitted token is the most likely one.
        assert all(entry.top[0][0] == entry.token_id for entry in result.logprobs)
    if k:  # accepted drafts were scored too, not just next tokens
        assert sum(r.stats["accepted"] for r in results) > 0
    # Asking for logprobs changes no token.
    assert [r.token_ids for r in results] == [r.token_ids for r in _engine(tiny_models, k).generate(PROMPTS,
                                                                                                      _greedy())]


def test_rows_ask_independently_in_one_batch(tiny_models) -> None:
    """A batch mixing rows that ask (with different numbers of alternatives) and rows that do not."""
    target = tiny_models[0]
    engine = _engine(tiny_models, 3)
    params = [_greedy(logprobs=20), _greedy(), _greedy(logprobs=0)]
    results = engine.generate(PROMPTS, params)
    _assert_matches(target, PROMPTS[0], results[0].token_ids, results[0].logprobs, 20)
    assert results[1].logprobs is None
    _assert_matches(target, PROMPTS[2], results[2].token_ids, results[2].logprobs, 0)


@pytest.mark.parametrize("k", [0, 4])
@pytest.mark.parametrize("seed", [7, None])
def test_sampled_logprobs_are_the_raw_models(tiny_models, k: int, seed: int | None) -> None:
    """Before temperature and top-p: a sampled token may lie outside the top-p set, but its logprob is finite and
    the raw model's."""
    target = tiny_models[0]
    engine = _engine(tiny_models, k)
    results = engine.generate(PROMPTS, _sampled(seed, logprobs=3))
    for prompt, result in zip(PROMPTS, results, strict=True):
        _assert_matches(target, prompt, result.token_ids, result.logprobs, 3)
    if k:
        assert sum(r.stats["accepted"] for r in results) > 0
    # Not all the most likely tokens: sampling (and resampling after a rejection) was exercised.
    assert any(entry.top[0][0] != entry.token_id for r in results for entry in r.logprobs)


def test_no_logprobs_asked_gives_none_everywhere(tiny_models) -> None:
    engine = _engine(tiny_models, 4)
    outputs = list(engine.stream(PROMPTS[0], _sampled(3)))
    assert outputs and all(out.logprobs is None for out in outputs)
    assert all(r.logprobs is None for r in engine.generate(PROMPTS, _greedy()))
    verifier = LocalVerifier(ModelRunner(tiny_models[0].model))
    results = verifier.verify([VerifyRequest("a", 0, PROMPTS[0], None, _greedy()),
                               VerifyRequest("b", 0, PROMPTS[1], None, _greedy(logprobs=1))])
    assert results[0].logprobs is None
    assert [entry.token_id for entry in results[1].logprobs] == [results[1].next_token]


def test_stop_string_cutting_a_block_keeps_logprobs_aligned(tiny_models) -> None:
    target, prompt = tiny_models[0], PROMPTS[0]
    # Uncut, each step's output is one round's whole block; a stopped run plays the same rounds up to its stop.
    full = list(_engine(tiny_models, 4).stream(prompt, _greedy(max_tokens=40, logprobs=2)))
    tokens = [t for out in full for t in out.new_token_ids]
    full_logprobs = [entry for out in full for entry in out.logprobs]
    _assert_matches(target, prompt, tokens, full_logprobs, 2)
    block_ends, at = set(), 0
    for out in full:
        at += len(out.new_token_ids)
        block_ends.add(at)
    text = _engine(tiny_models, 0).decode(tokens)
    # Stops at successive places until one ends the output inside a block (the block's later tokens are dropped).
    for start in range(4, len(text) - 3):
        stop = text[start : start + 3]
        outputs = list(_engine(tiny_models, 4).stream(prompt, _greedy(max_tokens=40, logprobs=2, stop=(stop,))))
        assert outputs[-1].finish_reason == "stop"
        for out in outputs:
            assert [entry.token_id for entry in out.logprobs] == out.new_token_ids
        emitted = [t for out in outputs for t in out.new_token_ids]
        logprobs = [entry for out in outputs for entry in out.logprobs]
        assert emitted == tokens[: len(emitted)]
        assert [e.logprob for e in logprobs] == pytest.approx([e.logprob for e in full_logprobs[: len(emitted)]],
                                                              abs=ATOL)
        if len(emitted) not in block_ends:
            _assert_matches(target, prompt, emitted, logprobs, 2)
            return
    pytest.fail("no stop string ended the output inside a block")


def test_engine_loop_updates_carry_logprobs(tiny_models) -> None:
    from tandem.gateway.handles import Submission
    from tandem.gateway.loop import EngineLoop

    target = tiny_models[0]
    reference = _engine(tiny_models, 3).generate([PROMPTS[1]], _greedy())[0]

    async def run() -> list:
        loop = EngineLoop(_engine(tiny_models, 3))
        await loop.start()
        try:
            asked = await loop.submit(Submission(PROMPTS[1], _greedy(logprobs=4), "asked"))
            plain = await loop.submit(Submission(PROMPTS[0], _greedy(), "plain"))
            return [[update async for update in asked], [update async for update in plain]]
        finally:
            await loop.close()

    asked, plain = asyncio.run(run())
    assert all(update.logprobs is None for update in plain)
    assert all(len(update.logprobs) == len(update.token_ids) for update in asked)
    tokens = [t for update in asked for t in update.token_ids]
    logprobs = [entry for update in asked for entry in update.logprobs]
    assert tokens == reference.token_ids  # its logprobs: batched with the other request, rounded alike only to ATOL
    _assert_matches(target, PROMPTS[1], tokens, logprobs, 4)


def test_logprobs_travel_through_ray_target_workers(tiny_models, tiny_dirs, ray_session) -> None:
    from tandem.core.local import LocalDrafter
    from tandem.workers.target_pool import RayVerifier, start_target_replicas
    from tandem.workers.worker_base import WorkerConfig

    target, draft, _ = tiny_models
    replicas = start_target_replicas(WorkerConfig(model=str(tiny_dirs.target), dtype="float32", threads=1), count=1)
    try:
        engine = SpeculativeEngine(RayVerifier(replicas), LocalDrafter(ModelRunner(draft.model)), _fixed(3))
        params = [_greedy(logprobs=3), _sampled(5, logprobs=1), _greedy()]
        results = engine.generate(PROMPTS, params)
    finally:
        for replica in replicas:
            ray_session.kill(replica)
    in_process = _engine(tiny_models, 3).generate(PROMPTS, params)
    assert [r.token_ids for r in results] == [r.token_ids for r in in_process]
    for prompt, result, top in zip(PROMPTS[:2], results, (3, 1), strict=False):
        _assert_matches(target, prompt, result.token_ids, result.logprobs, top)
    assert results[2].logprobs is None
