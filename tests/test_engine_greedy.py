"""Greedy speculative output is byte-identical to plain target decoding, alone and batched."""

from __future__ import annotations

import pytest
import torch

from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.core.costs import CostModel
from tandem.core.slots import MIN_CAPACITY
from tandem.engines.local import build_engine

# One worker for the module: its references (Hugging Face's generate of every prompt, about a minute on two cores)
# are a module fixture, which each worker that ran some of its tests would compute again.
pytestmark = pytest.mark.xdist_group("engine_greedy")
NEW_TOKENS = 64


def _prompts(vocab: int, count: int = 100) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1234)
    lengths = torch.randint(1, 40, (count,), generator=generator)
    return [torch.randint(0, vocab, (int(n),), generator=generator).tolist() for n in lengths]


def _reference(target, prompt: list[int]) -> list[int]:
    """Hugging Face's own greedy generate: an implementation that shares no code with ours."""
    ids = torch.tensor([prompt])
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                                min_new_tokens=NEW_TOKENS, pad_token_id=0, temperature=None, top_p=None, top_k=None)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def references(tiny_models):
    target = tiny_models[0]
    prompts = _prompts(len(target.tokenizer))
    return prompts, [_reference(target, p) for p in prompts]


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("batch", [1, 4])
def test_speculative_greedy_matches_plain_decoding(tiny_models, references, batch: int) -> None:
    target, draft, _ = tiny_models
    prompts, expected = references
    engine = build_engine(target, draft, EngineConfig(spec=SpecConfig(adaptive=False, k_init=4), calibrate=False))
    outputs = []
    for start in range(0, len(prompts), batch):
        outputs += [r.token_ids for r in engine.generate(prompts[start : start + batch], GREEDY)]
    mismatched = [i for i, (a, b) in enumerate(zip(outputs, expected, strict=True)) if a != b]
    assert not mismatched, f"{len(mismatched)} of {len(prompts)} prompts differ, first {mismatched[:5]}"
    assert not engine.verifier.runner.states and not engine.drafter.runner.states, "caches not released"


def test_plain_path_and_adaptive_path_match_reference(tiny_models, references) -> None:
    target, draft, _ = tiny_models
    prompts, expected = references
    plain = build_engine(target, None)
    # Priced so that drafting pays: whether it does with timed costs depends on the machine's speed.
    pays = CostModel(draft_step=0.001, verify={n: 0.1 for n in range(1, 10)}, draft_rows={16: 0.002},
                     batched={(16, w): 0.2 for w in range(1, 10)}, draft_forward={32: 0.002}, frozen=True)
    # Prompts of up to 40 tokens against a catch-up of 8 a round: most drafters catch up over several rounds, in
    # forwards of their own, while their rows decode plainly.
    adaptive = build_engine(target, draft, EngineConfig(spec=SpecConfig(batch_catch_up_limit=8), calibrate=False),
                            costs=pays)
    some = slice(0, 20)
    assert [r.token_ids for r in plain.generate(prompts[some], GREEDY)] == expected[some]
    results = adaptive.generate(prompts[some], GREEDY)
    assert [r.token_ids for r in results] == expected[some]
    # Every row drafts, the ones that started far behind too (a batch never shrinks to one row here: 20 at once).
    assert all(r.stats["drafted"] > 0 for r in results)
    assert sum(r.stats["accepted"] for r in results) > 0


@pytest.mark.parametrize("options", [{"draft_vocab": 200, "adaptive": False}, {"draft_confidence": 0.5}])
def test_draft_side_shortcuts_stay_exact(tiny_models, references, options: dict) -> None:
    target, draft, _ = tiny_models
    prompts, expected = references
    # Uncalibrated, the adaptive policy drafts k_init tokens a round: the confidence stop is what shortens rounds.
    engine = build_engine(target, draft, EngineConfig(spec=SpecConfig(k_init=4, **options), calibrate=False))
    results = engine.generate(prompts[:20], GREEDY)
    assert [r.token_ids for r in results] == expected[:20]
    assert sum(r.stats["accepted"] for r in results) > 0
    if "draft_vocab" in options:
        assert engine.drafter.runner.vocab_size == 200
    else:
        cut_short = sum(n for r in results for k, n in r.stats["rounds_by_k"].items() if 0 < int(k) < 4)
        assert cut_short > len(results), "more rounds stopped early than the one final round k is clamped in"


def test_greedy_rows_beside_sampled_ones_stay_exact(tiny_models, references) -> None:
    """A batch mixing greedy and sampled rows: verification chooses the greedy rows together and the drafter each row
    on its own, and every row gets what it would alone: the greedy ones plain greedy decoding, the seeded ones plain
    decoding with their seed, the unseeded one as many tokens as asked."""
    target, draft, _ = tiny_models
    prompts, expected = references
    seeded = [SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_tokens=NEW_TOKENS, ignore_eos=True)
              for seed in (5, 9)]
    unseeded = SamplingParams(temperature=0.8, max_tokens=NEW_TOKENS, ignore_eos=True)
    params = [GREEDY, seeded[0], GREEDY, seeded[1], unseeded]
    engine = build_engine(target, draft, EngineConfig(spec=SpecConfig(adaptive=False, k_init=3), calibrate=False))
    results = engine.generate(prompts[:5], params)
    plain = build_engine(target, None)
    alone = [plain.generate([prompts[i]], params[i])[0].token_ids for i in (1, 3)]
    assert [results[i].token_ids for i in (0, 2)] == [expected[0], expected[2]]
    assert [results[i].token_ids for i in (1, 3)] == alone
    assert len(results[4].token_ids) == NEW_TOKENS
    assert all(r.stats["drafted"] > 0 for r in results)


def test_a_fixed_k_drafts_every_token_whatever_the_confidence(tiny_models) -> None:
    target, draft, _ = tiny_models
    assert SpecConfig(adaptive=False, k_init=4, draft_confidence=0.8).stop_confidence == 0.0
    assert build_engine(target, draft, EngineConfig(spec=SpecConfig(adaptive=False, k_init=4),
                                                    calibrate=False)).drafter.confidence == 0.0
    adaptive = build_engine(target, draft, EngineConfig(calibrate=False))
    assert adaptive.drafter.confidence == SpecConfig().draft_confidence > 0


def test_unrelated_draft_is_still_exact(tiny_models, references) -> None:
    target, _, draft_random = tiny_models
    prompts, expected = references
    config = EngineConfig(spec=SpecConfig(adaptive=False, k_init=3), calibrate=False)
    engine = build_engine(target, draft_random, config)
    assert [r.token_ids for r in engine.generate(prompts[:12], GREEDY)] == expected[:12]


def test_stats_describe_the_rounds(tiny_models, references) -> None:
    target, draft, _ = tiny_models
    prompts, _ = references
    engine = build_engine(target, draft, EngineConfig(spec=SpecConfig(adaptive=False, k_init=4), calibrate=False))
    stats = engine.generate([prompts[0]], GREEDY)[0].stats
    final_plain_rounds = stats["rounds_by_k"].get("0", 0)  # k is clamped to the tokens still allowed
    assert final_plain_rounds <= 1 and stats["rounds"] == stats["spec_rounds"] + final_plain_rounds
    assert stats["drafted"] == sum(int(k) * n for k, n in stats["rounds_by_k"].items())
    assert 0 < stats["accepted"] <= stats["drafted"]
    per_position = stats["acceptance_per_position"]
    assert len(per_position) == 4 and per_position == sorted(per_position, reverse=True)
    emitted = stats["accepted"] + stats["spec_rounds"]
    assert emitted + final_plain_rounds >= NEW_TOKENS
    assert abs(stats["mean_accepted_length"] - emitted / stats["spec_rounds"]) < 1e-3


def _run_session(engine, prompt: list[int], session: str) -> list[int]:
    engine.add_request(prompt, GREEDY, session_id=session)
    request_id = next(iter(engine.sequences))
    seq = engine.sequences[request_id]
    while engine.has_unfinished():
        engine.step()
    return seq.output


def test_a_sessions_next_turn_reuses_the_cached_prefix(tiny_models, references) -> None:
    target, draft, _ = tiny_models
    prompts, expected = references
    engine = build_engine(target, draft, EngineConfig(spec=SpecConfig(adaptive=False, k_init=4), calibrate=False))
    fresh = build_engine(target, None, EngineConfig(calibrate=False))
    first = _run_session(engine, prompts[0], "chat-1")
    assert first == expected[0]
    assert set(engine.verifier.runner.retained) == {"chat-1"} and not engine.verifier.runner.states
    second_prompt = prompts[0] + first + prompts[1][:5]
    second = _run_session(engine, second_prompt, "chat-1")
    assert second == fresh.generate([second_prompt], GREEDY)[0].token_ids
    # The target had the first turn's prompt and output cached; the draft at least the prompt.
    assert engine.verifier.runner.reused_tokens >= len(prompts[0]) + len(first) - 1
    assert engine.drafter.runner.reused_tokens >= len(prompts[0])
    _run_session(engine, prompts[2], "")  # no session: kept for its prefix alone, no session's
    assert engine.verifier.runner.retained_sessions == 1 and "chat-1" in engine.verifier.runner.retained


def test_retained_sessions_are_bounded_and_aborts_are_not_retained(tiny_models, references) -> None:
    target, _, _ = tiny_models
    prompts, _ = references
    engine = build_engine(target, None, EngineConfig(calibrate=False), retain_tokens=2 * MIN_CAPACITY)
    for i in range(6):
        _run_session(engine, prompts[i], f"s{i}")
    runner = engine.verifier.runner
    retained = runner.retained
    assert len(retained) * runner.cache.capacity <= 2 * MIN_CAPACITY and "s5" in retained and "s0" not in retained
    request_id = engine.add_request(prompts[7], GREEDY, session_id="aborted")
    engine.step()
    engine.abort(request_id)
    assert "aborted" not in retained and not engine.verifier.runner.states


def test_an_unsure_draft_keeps_pace_with_sure_batch_mates_only() -> None:
    from tandem.core.local import LocalDrafter

    drafter = LocalDrafter(runner=None, confidence=0.8)  # type: ignore[arg-type]  # the stop rule reads no model
    alone = [4]
    drafter._stop_unsure([0], [0.5], alone, step=0)
    assert alone == [1]  # alone, an unsure draft is its last
    # Rows 0 and 3 are sure (budgets 4 and 5): unsure rows 1 and 2 go on as far as the farthest of them, 5, and no
    # further than their own budget.
    budget = [4, 6, 2, 5]
    drafter._stop_unsure([0, 1, 2, 3], [0.9, 0.3, 0.5, 0.95], budget, step=1)
    assert budget == [4, 5, 2, 5]
    budget = [4, 6, 3]
    drafter._stop_unsure([0, 1, 2], [0.1, 0.3, 0.5], budget, step=1)
    assert budget == [2, 2, 2]  # every row unsure: the block ends for all of them
