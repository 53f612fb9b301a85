"""Chunked prefill: while others decode, a new prompt is cached a chunk per step, and output stays exact."""

from __future__ import annotations

import pytest

from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.core.local import LocalVerifier
from tandem.core.protocol import VerifyRequest, VerifyResult
from tandem.core.runner import ModelRunner
from tandem.engines.local import build_engine
from tandem.errors import InvalidArgument

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
LONGER = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)  # still decoding after LONG's prefill
SHORT = [72, 101, 108, 108, 111]
LONG = [(7 * i + 3) % 300 for i in range(150)]
FIXED_K = SpecConfig(adaptive=False, k_init=3)


@pytest.fixture(scope="module")
def expected(tiny_models) -> dict[str, list[int]]:
    plain = build_engine(tiny_models[0], None, EngineConfig(calibrate=False, prefill_chunk=0))
    return {"short": plain.generate([SHORT], LONGER)[0].token_ids, "long": plain.generate([LONG], GREEDY)[0].token_ids}


def _newcomer_while_decoding(engine, chunk_steps: list[int]) -> tuple[list[int], list[int], int]:
    """SHORT starts decoding; then LONG arrives. Returns both outputs and the step at which LONG's first token came
    (1 = the step after its arrival). `chunk_steps` collects the target's cached length of LONG after each step."""
    short = engine.sequences[engine.add_request(SHORT, LONGER)]
    engine.step()
    long = engine.sequences[engine.add_request(LONG, GREEDY)]
    first_token_step, steps = 0, 0
    while engine.has_unfinished():
        before = len(short.output)
        engine.step()
        steps += 1
        if not short.finish_reason:
            assert len(short.output) > before, "the decoding sequence must get tokens every step"
        if long.output and not first_token_step:
            first_token_step = steps
        if not long.output:
            chunk_steps.append(engine.verifier.runner.states[long.request_id].cached)
    return short.output, long.output, first_token_step


@pytest.mark.parametrize("spec", [FIXED_K, SpecConfig()], ids=["fixed-k", "adaptive"])
def test_a_long_prompt_is_prefilled_a_chunk_per_step_while_another_decodes(tiny_models, expected, spec) -> None:
    target, draft, _ = tiny_models
    engine = build_engine(target, draft, EngineConfig(spec=spec, calibrate=False, prefill_chunk=16))
    cached: list[int] = []
    short, long, first = _newcomer_while_decoding(engine, cached)
    assert short == expected["short"] and long == expected["long"]
    # 149 tokens are cached before LONG is first scored: 9 chunks of 16, then the last 5 with its first round.
    assert cached == [16 * i for i in range(1, 10)]
    assert first == 10


def test_without_chunks_the_whole_prompt_is_prefilled_in_one_step(tiny_models, expected) -> None:
    target, draft, _ = tiny_models
    engine = build_engine(target, draft, EngineConfig(spec=FIXED_K, calibrate=False, prefill_chunk=0))
    short, long, first = _newcomer_while_decoding(engine, [])
    assert (short, long, first) == (expected["short"], expected["long"], 1)


def test_prompts_arriving_together_are_not_chunked(tiny_models, expected) -> None:
    """Nobody is decoding yet, so nothing waits for their prefill: the first tokens come as soon as possible."""
    target, draft, _ = tiny_models
    engine = build_engine(target, draft, EngineConfig(spec=FIXED_K, calibrate=False, prefill_chunk=16))
    seqs = [engine.sequences[engine.add_request(p, params)] for p, params in ((SHORT, LONGER), (LONG, GREEDY))]
    engine.step()
    assert all(len(seq.output) >= 1 for seq in seqs)
    while engine.has_unfinished():
        engine.step()
    assert [seq.output for seq in seqs] == [expected["short"], expected["long"]]


def test_a_retained_prefix_is_not_prefilled_again(tiny_models, expected) -> None:
    """A session's next turn has most of its prompt cached: only the uncached part counts against the chunk."""
    target, draft, _ = tiny_models
    engine = build_engine(target, draft, EngineConfig(spec=FIXED_K, calibrate=False, prefill_chunk=16))
    first_turn = engine.sequences[engine.add_request(LONG, GREEDY, session_id="chat")]
    while engine.has_unfinished():
        engine.step()
    next_turn = LONG + first_turn.output + [11, 12, 13]
    short = engine.sequences[engine.add_request(SHORT, LONGER)]
    engine.step()
    second = engine.sequences[engine.add_request(next_turn, GREEDY, session_id="chat")]
    engine.step()
    assert second.output, "only 4 uncached tokens: the first token comes in the first step"
    while engine.has_unfinished():
        engine.step()
    assert short.output == expected["short"]
    plain = build_engine(target, None, EngineConfig(calibrate=False))
    assert second.output == plain.generate([next_turn], GREEDY)[0].token_ids


def test_the_verifier_caches_at_most_the_limit_and_scores_once_all_is_cached(tiny_models) -> None:
    verifier = LocalVerifier(ModelRunner(tiny_models[0].model))
    request = VerifyRequest("s", 0, LONG[:40], None, GREEDY, prefill_limit=16)
    assert verifier.verify([request])[0] == VerifyResult.prefill_goes_on()
    assert verifier.runner.states["s"].cached == 16
    again = VerifyRequest("s", 40, [], None, GREEDY, prefill_limit=16)
    assert verifier.verify([again])[0].prefilling and verifier.runner.states["s"].cached == 32
    result = verifier.verify([again])[0]  # 7 uncached tokens left: cached, then scored
    assert not result.prefilling and result.next_token is not None and result.next_token >= 0
    assert verifier.runner.states["s"].cached == 40 and len(verifier.runner.states["s"].tokens) == 41


def test_a_prompt_is_fed_in_the_forward_that_scores_it_unless_that_would_pad_its_batch_mates(tiny_models,
                                                                                           monkeypatch) -> None:
    """A lone new prompt, or new prompts arriving together, take one forward that caches the prompt and scores its
    last token (a second forward would read every weight again for one token a row). So does a prompt beside rows
    that only decode, packed into one row with them (core.row_layout); where packing does not pay, it is prefilled in
    a forward of its own, so theirs stays one token wide. Same tokens either way (float32)."""
    from tandem.core.row_layout import RowLayout

    runner = ModelRunner(tiny_models[0].model, prefix_cache=False)  # the prompts share prefixes: all are computed
    verifier = LocalVerifier(runner)
    widths: list[tuple[int, int]] = []
    hidden = runner._hidden
    runner._hidden = lambda ids, *rest: widths.append(tuple(ids.shape)) or hidden(ids, *rest)
    alone = verifier.verify([VerifyRequest("a", 0, LONG[:40], None, GREEDY)])[0]
    assert widths == [(1, 40)]
    widths.clear()
    together = verifier.verify([VerifyRequest(name, 0, LONG[:n], None, GREEDY)
                                for name, n in (("b", 40), ("c", 36))])
    assert widths == [(1, 76)] and together[0].next_token == alone.next_token  # packed: 40 + 36 tokens, no padding
    widths.clear()
    decoding = VerifyRequest("a", 41, [], None, GREEDY)  # "a" decodes on from its first token
    newcomer = VerifyRequest("d", 0, LONG[:40], None, GREEDY)
    results = verifier.verify([decoding, newcomer])
    assert widths == [(1, 41)] and results[1].next_token == alone.next_token
    widths.clear()
    monkeypatch.setattr(runner, "layout", RowLayout("cpu", can_pack=False))
    decoding = VerifyRequest("a", 42, [], None, GREEDY)
    newcomer = VerifyRequest("e", 0, LONG[:40], None, GREEDY)
    results = verifier.verify([decoding, newcomer])
    assert len(widths) == 2 and widths[0][1] == 39 and widths[1][1] == 1  # the prompt alone, then one token each
    assert results[1].next_token == alone.next_token
    plain = build_engine(tiny_models[0], None, EngineConfig(calibrate=False))
    assert plain.generate([LONG[:40]], SamplingParams(temperature=0.0, max_tokens=1))[0].token_ids == [
        alone.next_token]


def test_a_negative_chunk_is_rejected() -> None:
    with pytest.raises(InvalidArgument, match="prefill_chunk"):
        EngineConfig(prefill_chunk=-1)


def test_sampled_newcomer_prefilled_in_chunks_keeps_its_seeded_tokens(tiny_models) -> None:
    """Sampled, not only greedy: a client-seeded prompt cached a chunk per step while another sequence decodes gives
    the tokens plain decoding gives that seed in one prefill, with speculation on."""
    seeded_long = SamplingParams(temperature=0.9, top_p=0.95, seed=3, max_tokens=24, ignore_eos=True)
    seeded_short = SamplingParams(temperature=0.9, top_p=0.95, seed=4, max_tokens=80, ignore_eos=True)
    plain = build_engine(tiny_models[0], None, EngineConfig(calibrate=False, prefill_chunk=0))
    want_short = plain.generate([SHORT], seeded_short)[0].token_ids
    want_long = plain.generate([LONG], seeded_long)[0].token_ids
    engine = build_engine(tiny_models[0], tiny_models[1], EngineConfig(spec=FIXED_K, calibrate=False,
                                                                       prefill_chunk=16))
    short = engine.sequences[engine.add_request(SHORT, seeded_short)]
    engine.step()
    long = engine.sequences[engine.add_request(LONG, seeded_long)]
    engine.step()
    assert long.prefill_started and not long.output  # the newcomer is being prefilled in chunks
    while engine.has_unfinished():
        engine.step()
    assert (short.output, long.output) == (want_short, want_long)
    assert short.stats.accepted > 0


def _cached(engine, seq) -> int:
    return engine.verifier.runner.states[seq.request_id].cached


def test_a_long_prompt_alone_is_prefilled_in_steps_of_max_prefill_tokens(tiny_models, expected) -> None:
    """Nothing else runs, yet a prompt longer than max_prefill_tokens is cached that many tokens a step, so steps
    end often enough for a request arriving meanwhile to join and an abort to land. Same tokens."""
    target, draft, _ = tiny_models
    engine = build_engine(target, draft, EngineConfig(spec=FIXED_K, calibrate=False, prefill_chunk=16,
                                                      max_prefill_tokens=40))
    long = engine.sequences[engine.add_request(LONG, GREEDY)]
    cached = []
    while not long.output:
        engine.step()
        cached.append(_cached(engine, long))
    assert cached == [40, 80, 120, 150]  # three chunks of 40, then the last 30 in its first round
    while engine.has_unfinished():
        engine.step()
    assert long.output == expected["long"]


def test_a_request_arriving_during_a_long_prefill_gets_its_first_token_in_the_next_step(tiny_models,
                                                                                       expected) -> None:
    """The newcomer's prompt is prefilled whole in the next step, beside one prefill_chunk of the long prompt (not
    another max_prefill_tokens of it); then it decodes while the long prompt goes on a prefill_chunk a step."""
    target, draft, _ = tiny_models
    engine = build_engine(target, draft, EngineConfig(spec=FIXED_K, calibrate=False, prefill_chunk=16,
                                                      max_prefill_tokens=40))
    long = engine.sequences[engine.add_request(LONG, GREEDY)]
    engine.step()
    short = engine.sequences[engine.add_request(SHORT, LONGER)]
    engine.step()
    assert short.output and _cached(engine, long) == 56
    cached = []
    while not long.output:
        engine.step()
        cached.append(_cached(engine, long))
    assert cached == [72, 88, 104, 120, 136, 150]
    while engine.has_unfinished():
        engine.step()
    assert (short.output, long.output) == (expected["short"], expected["long"])


def test_long_prompts_arriving_together_still_share_their_prefix(tiny_models) -> None:
    """Every row capped, none waits on the step: the first computes the prefix they share and the others copy it,
    as uncapped prompts arriving together do (a request's n choices, a burst with one long system prompt)."""
    target, draft, _ = tiny_models
    prompts = [LONG + [20 + i, 30 + i] for i in range(3)]
    plain = build_engine(target, None, EngineConfig(calibrate=False, max_prefill_tokens=0))
    want = [plain.generate([prompt], GREEDY)[0].token_ids for prompt in prompts]
    engine = build_engine(target, draft, EngineConfig(spec=FIXED_K, calibrate=False, max_prefill_tokens=40))
    seqs = [engine.sequences[engine.add_request(prompt, GREEDY)] for prompt in prompts]
    engine.step()
    assert all(seq.output for seq in seqs)  # the shared 150 tokens copied, each row's 1 more within its cap
    assert engine.verifier.runner.shared_tokens == 2 * len(LONG)
    while engine.has_unfinished():
        engine.step()
    assert [seq.output for seq in seqs] == want


@pytest.mark.parametrize("cap", [40, 0])
def test_a_drafter_far_behind_catches_up_max_prefill_tokens_a_round(tiny_models, expected, cap) -> None:
    """A lone row's drafter, a whole prompt behind, takes it in max_prefill_tokens a round while the target decodes
    plainly, then drafts: no draft step takes in the whole prompt (with no cap, the first takes all 150). Same
    tokens."""
    target, draft, _ = tiny_models
    engine = build_engine(target, draft, EngineConfig(spec=FIXED_K, calibrate=False, max_prefill_tokens=cap))
    sent: list[int] = []
    propose = engine.drafter.propose
    engine.drafter.propose = lambda requests: sent.extend(len(r.append) for r in requests) or propose(requests)
    long = engine.sequences[engine.add_request(LONG, GREEDY)]
    while engine.has_unfinished():
        engine.step()
    assert long.output == expected["long"] and long.stats.accepted > 0
    assert (max(sent) <= 40 and sent[:3] == [40, 40, 40]) if cap else sent[0] >= len(LONG)
