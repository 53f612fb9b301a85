"""How the whole engine drafts: per-session fallback engages with an unrelated draft and disengages with an aligned
one, new sessions start from the deployment's recent acceptance, the first round only prefills the target, batched
rows far behind in the drafter catch up in chunks, and rows that rest or may not draft share rounds with mates that
draft, their output still plain greedy decoding's."""

from __future__ import annotations

from engine_harness import (  # the fixture by its name: plain_output
    PROMPT,
    _greedy,
    plain_output_fixture,  # noqa: F401
)
from tandem.core.config import EngineConfig, SpecConfig
from tandem.core.costs import CostModel
from tandem.engines.local import build_engine


def _static_costs() -> CostModel:
    # Draft step at a third of a target step, verification growing 5% per extra token: like the real pair here.
    return CostModel(draft_step=0.3, verify={n: 1.0 + 0.05 * (n - 1) for n in range(1, 12)}, frozen=True)


def test_fallback_engages_with_unrelated_draft_and_disengages_with_aligned(tiny_models) -> None:
    target, draft, draft_random = tiny_models
    config = EngineConfig(spec=SpecConfig(probe_interval=4, probe_interval_max=16), calibrate=False)
    engine = build_engine(target, draft_random, config, costs=_static_costs())
    request_id = engine.add_request(PROMPT, _greedy(max_tokens=400))
    seq = engine.sequences[request_id]
    for _ in range(40):
        engine.step()
    assert seq.policy.fallback and seq.stats.fallback_rounds > 25
    engine.drafter = build_engine(target, draft, config).drafter  # the draft starts agreeing
    rounds_before = seq.stats.rounds
    for _ in range(60):
        engine.step()
    assert not seq.policy.fallback
    assert seq.stats.rounds - rounds_before - (seq.stats.fallback_rounds - 25) > 0
    assert seq.stats.accepted_at[0] > 10


def test_new_sessions_start_from_the_deployments_recent_acceptance(tiny_models) -> None:
    target, draft, draft_random = tiny_models
    config = EngineConfig(spec=SpecConfig(probe_interval=4, probe_interval_max=16), calibrate=False)
    for drafter, starts_speculating in ((draft_random, False), (draft, True)):
        engine = build_engine(target, drafter, config, costs=_static_costs())
        for prompt in (PROMPT, PROMPT[:3], PROMPT[1:]):
            engine.generate([prompt], _greedy(max_tokens=60))
        request_id = engine.add_request(PROMPT[2:], _greedy(max_tokens=20))
        first = engine.sequences[request_id]
        engine.step()
        assert first.stats.spec_rounds == 0 and len(first.output) == 1  # the first round only prefills the target
        engine.step()
        # The shared prior has learned what this draft does: no evidence-free first rounds against it.
        assert (first.stats.spec_rounds == 1) == starts_speculating, engine.prior.value
    assert engine.prior.value > 0.6


def test_first_round_only_prefills_the_target(tiny_models, plain_output) -> None:
    target, draft, _ = tiny_models
    for plain_first, first_round_drafts in ((True, False), (False, True)):
        engine = build_engine(target, draft, EngineConfig(spec=SpecConfig(plain_first_round=plain_first),
                                                          calibrate=False), costs=_static_costs())
        seq = engine.sequences[engine.add_request(PROMPT, _greedy(max_tokens=30))]
        engine.step()
        assert (seq.stats.spec_rounds == 1) == first_round_drafts and (seq.draft_synced > 0) == first_round_drafts
        if not first_round_drafts:
            assert seq.output == plain_output[:1]
            engine.step()  # the drafter catches up on the whole prompt and speculates
            assert seq.stats.spec_rounds == 1 and seq.draft_synced >= len(PROMPT)
        while engine.has_unfinished():
            engine.step()
        assert seq.output == plain_output[:30]


def test_batched_rows_far_behind_in_the_drafter_catch_up_in_chunks_then_draft(tiny_models) -> None:
    target, draft, _ = tiny_models
    cheap = CostModel(draft_step=0.01, verify={n: 1.0 for n in range(1, 12)}, draft_rows={2: 0.01},
                      batched={(2, w): 1.0 for w in range(1, 12)}, frozen=True)  # drafting always pays
    long_prompt, short_prompt = list(range(40, 80)), PROMPT
    for prompts, drafts in (([long_prompt, long_prompt[1:]], False), ([short_prompt, short_prompt[1:]], True),
                            ([long_prompt], True)):
        engine = build_engine(target, draft, EngineConfig(spec=SpecConfig(), calibrate=False), costs=cheap)
        seqs = [engine.sequences[engine.add_request(p, _greedy(max_tokens=20))] for p in prompts]
        engine.step()
        engine.step()  # the first round was plain; now each drafter is a whole prompt behind
        assert all((seq.stats.spec_rounds == 1) == drafts for seq in seqs), (len(prompts[0]), len(prompts))
        if not drafts:  # their drafters took the first 32 tokens of the backlog, in one forward of their own
            assert [seq.draft_synced for seq in seqs] == [SpecConfig().batch_catch_up_limit] * 2
            engine.step()  # 10 and 9 tokens behind now: a catch-up the plan prices, and drafting pays
            assert all(seq.stats.spec_rounds == 1 for seq in seqs)


def test_a_row_resting_beside_a_drafting_mate_keeps_its_drafter_in_step(tiny_models, plain_output) -> None:
    """A session in fallback decodes plainly, but rides its mate's first draft step with the token its drafter
    lacks: it never falls behind, so drafting again costs it no catch-up. The tokens stay the plain ones."""
    target, draft, _ = tiny_models
    cheap = CostModel(draft_step=0.01, verify={n: 1.0 for n in range(1, 12)}, draft_rows={2: 0.01},
                      batched={(2, w): 1.0 for w in range(1, 12)}, frozen=True)  # drafting always pays
    engine = build_engine(target, draft, EngineConfig(spec=SpecConfig(probe_interval=64), calibrate=False),
                          costs=cheap)
    drafting, resting = (engine.sequences[engine.add_request(PROMPT, _greedy(max_tokens=40))] for _ in range(2))
    engine.step()
    engine.step()  # the first round was plain; in the second both drafters caught up and drafted
    assert drafting.stats.spec_rounds == resting.stats.spec_rounds == 1
    resting.policy.fallback, resting.policy.rejected, resting.policy.accepted = True, 1000.0, 0.0
    resting.policy.probe_interval = 64  # no probe due in these rounds
    for _ in range(6):
        engine.step()
        assert resting.stats.spec_rounds == 1 and drafting.stats.spec_rounds > 1
        assert len(resting.context) - resting.draft_synced <= 1  # the token committed in this round
    while engine.has_unfinished():
        engine.step()
    assert drafting.output == resting.output == plain_output[:40]


def test_rows_that_gain_draft_while_a_batch_mate_decodes_plainly(tiny_models) -> None:
    """A session that may not draft (max_k 0, as for one in fallback) shares each round's forward with mates that
    draft: the round is mixed, not plain for all, and every row's output is still plain greedy decoding's."""
    target, draft, _ = tiny_models
    cheap = CostModel(draft_step=0.01, verify={n: 1.0 for n in range(1, 12)}, draft_rows={3: 0.01, 2: 0.01},
                      batched={(3, w): 1.0 for w in range(1, 12)}, frozen=True)  # drafting pays for the rows it has
    prompts = [PROMPT, PROMPT[1:], PROMPT[2:]]
    plain = [r.token_ids for r in build_engine(target, None).generate(prompts, _greedy(max_tokens=24))]
    engine = build_engine(target, draft, EngineConfig(spec=SpecConfig(), calibrate=False), costs=cheap)
    seqs = [engine.sequences[engine.add_request(p, _greedy(max_tokens=24), max_k=0 if i == 0 else None)]
            for i, p in enumerate(prompts)]
    mixed_rounds = 0
    while engine.sequences:
        before = [seq.stats.spec_rounds for seq in seqs]
        rounds = [seq.stats.rounds for seq in seqs]
        engine.step()
        stepped = [seq.stats.rounds > r for seq, r in zip(seqs, rounds, strict=True)]
        drafted = [seq.stats.spec_rounds > b for seq, b in zip(seqs, before, strict=True)]
        mixed_rounds += all(stepped) and not drafted[0] and any(drafted[1:])
    assert seqs[0].stats.drafted == 0 and all(seq.stats.drafted > 0 for seq in seqs[1:])
    assert mixed_rounds > 0
    assert [seq.output for seq in seqs] == plain


def test_only_rounds_whose_rows_drafted_alike_price_the_padded_forward(tiny_models, monkeypatch) -> None:
    """The batch plan prices a round as its rows padded to the widest; rows of uneven widths may run packed
    (core.row_layout), cheaper than that, so their timing would price the padded shape too low. A row that may not
    draft beside mates that do makes every drafting round uneven: only the plain rounds are observed."""
    target, draft, _ = tiny_models
    observed: list[tuple[int, int]] = []
    original = CostModel.observe_verify

    def spy(self, tokens: int, seconds: float, rows: int = 1) -> None:
        observed.append((tokens, rows))
        original(self, tokens, seconds, rows)

    monkeypatch.setattr(CostModel, "observe_verify", spy)
    cheap = CostModel(draft_step=0.01, verify={n: 1.0 for n in range(1, 12)}, draft_rows={3: 0.01, 2: 0.01},
                      batched={(3, w): 1.0 for w in range(1, 12)}, frozen=True)  # drafting pays for the rows it has
    engine = build_engine(target, draft, EngineConfig(spec=SpecConfig(), calibrate=False), costs=cheap)
    seqs = [engine.sequences[engine.add_request(p, _greedy(max_tokens=24), max_k=0 if i == 0 else None)]
            for i, p in enumerate([PROMPT, PROMPT[1:], PROMPT[2:]])]
    while engine.sequences:
        engine.step()
    assert all(seq.stats.drafted > 0 for seq in seqs[1:])
    assert observed and all(tokens == 1 for tokens, rows in observed if rows > 1)
