"""Stops, cache rollback, per-session fallback and sampled losslessness through the whole engine."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from marginals import assert_second_tokens_follow
from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.core.costs import CostModel
from tandem.core.runner import ModelRunner
from tandem.engines.local import build_engine
from tandem.errors import InvalidArgument

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]
FIXED_K = EngineConfig(spec=SpecConfig(adaptive=False, k_init=4), calibrate=False)


def _greedy(max_tokens: int = 48, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def plain_output(tiny_models) -> list[int]:
    return build_engine(tiny_models[0], None).generate([PROMPT], _greedy())[0].token_ids


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


def test_calibration_times_real_batches_and_leaves_no_state(tiny_models) -> None:
    target, draft, _ = tiny_models
    engine = build_engine(target, draft, EngineConfig(spec=SpecConfig(k_max=3, k_init=2), max_batch=4))
    costs = engine.costs
    assert set(costs.verify) >= {1, 2, 3, 4} and costs.draft_step > 0
    assert set(costs.batched) == {(rows, width) for rows in (2, 4) for width in (1, 2, 3)}
    assert set(costs.draft_rows) == {2, 4} and all(seconds > 0 for seconds in costs.batched.values())
    assert set(costs.draft_forward) == {4, 8, 16, 32} and costs.draft_forward[4] <= costs.draft_forward[32]
    assert not engine.verifier.runner.states and not engine.drafter.runner.states


def test_calibration_records_batches_as_the_rows_the_target_computes(tiny_models) -> None:
    """Under a layout whose static forwards run 6 rows as 8 (a compiled runner's row buckets), calibration at
    --max-batch 6 records its widest batches as 8 rows, as the batch plan prices them; so no batch of up to 6 rows is
    priced from single-sequence forwards wider than k_max + 1, which calibration no longer times."""
    from tandem.core.calibration import calibrate
    from tandem.core.row_layout import RowLayout

    target, draft, _ = tiny_models
    engine = build_engine(target, draft, EngineConfig(spec=SpecConfig(k_max=3, k_init=2), calibrate=False))
    engine.verifier.row_layout = RowLayout("cpu", can_pack=False, padded_up_to=16, row_buckets=(1, 2, 4, 8))
    costs = calibrate(engine.verifier, engine.drafter, k_max=3, k_init=2, max_batch=6)
    assert {rows for rows, _ in costs.batched} == {2, 4, 8} and set(costs.verify) == {1, 2, 3, 4}
    with_wide = CostModel(**{name: getattr(costs, name) for name in ("draft_step", "draft_rows", "batched")},
                          verify=costs.verify | {n: 100.0 * n for n in (8, 12, 16, 24, 32)}, layout=costs.layout)
    for rows in range(1, 7):
        for width in range(1, 5):
            assert costs.batch_forward_time(rows, width) == with_wide.batch_forward_time(rows, width)
    assert not engine.verifier.runner.states and not engine.drafter.runner.states


def test_a_fixed_k_engine_starts_without_calibrating(tiny_models) -> None:
    target, draft, _ = tiny_models
    engine = build_engine(target, draft, EngineConfig(spec=SpecConfig(k_max=3, k_init=3, adaptive=False)))
    assert not engine.costs.calibrated
    result = engine.generate([PROMPT], _greedy(max_tokens=12))[0]
    assert result.stats["drafted"] > 0 and not result.stats["fallback"]


def test_measured_costs_put_random_draft_into_fallback(tiny_models) -> None:
    target, _, draft_random = tiny_models
    engine = build_engine(target, draft_random)
    assert engine.costs.calibrated
    result = engine.generate([PROMPT], _greedy(max_tokens=200))[0]
    assert result.stats["fallback"] and result.stats["fallback_rounds"] > result.stats["rounds"] // 2


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


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"max_tokens": 0}, "max_tokens"), ({"seed": -5}, "seed"),
    ({"stop": ("",)}, "stop"), ({"stop_token_ids": (-1,)}, "stop_token_ids"),
])
def test_bad_sampling_parameters_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidArgument, match=f"^{field}:"):
        SamplingParams(**kwargs)


def test_bad_requests_are_rejected_with_clear_errors(tiny_models) -> None:
    engine = build_engine(tiny_models[0], tiny_models[1], FIXED_K)
    with pytest.raises(InvalidArgument, match=r"^prompt:"):
        engine.add_request([], _greedy())
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        engine.add_request([1, 10**6], _greedy())
    with pytest.raises(InvalidArgument, match=r"^stop_token_ids: \[1000000\] are outside the vocabulary"):
        engine.add_request(PROMPT, dataclasses.replace(_greedy(), stop_token_ids=(5, 10**6)))
    engine.add_request(PROMPT, _greedy(), request_id="x")
    with pytest.raises(InvalidArgument, match="already running"):
        engine.add_request(PROMPT, _greedy(), request_id="x")
    engine.abort("x")
    assert not engine.has_unfinished() and not engine.verifier.runner.states
    with pytest.raises(InvalidArgument, match=r"^k_max:"):
        SpecConfig(k_max=-1)


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


def test_in_process_arms_sharing_the_target_step_at_once_and_each_gets_its_own_tokens(tiny_dirs) -> None:
    """`serve --in-process` with canary arms loads the target once and runs an engine per arm, each on its own
    thread: their forwards on the one model object take turns (core.attention.forward_lock), where they once
    switched its attention implementation under each other (KeyError 'tandem_segments', or rows attended as one)."""
    import threading

    from tandem.engines.local import build_local_backends
    from tandem.engines.options import Arm, LocalOptions

    arms = (Arm("baseline", str(tiny_dirs.draft), FIXED_K), Arm("canary", str(tiny_dirs.draft_random), FIXED_K))
    backends = build_local_backends(str(tiny_dirs.target), arms, LocalOptions(device="cpu", dtype="float32"))
    engines = [backends[arm.name].engine for arm in arms]
    assert engines[0].verifier.runner.model is engines[1].verifier.runner.model
    prompts = [[(i * 31 + j * 7) % 250 + 3 for j in range(5 + 9 * i)] for i in range(6)]  # widths that pack
    alone = [[r.token_ids for r in engine.generate(prompts, _greedy(40))] for engine in engines]
    together: dict[tuple[int, int], list[list[int]]] = {}
    failures: list[BaseException] = []

    def run(arm: int) -> None:
        try:
            for repeat in range(4):
                together[arm, repeat] = [r.token_ids for r in engines[arm].generate(prompts, _greedy(40))]
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(arm,)) for arm in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not failures, failures
    assert all(together[arm, repeat] == alone[arm] for arm in range(2) for repeat in range(4))


def test_the_engine_has_every_member_the_serving_layers_use(tiny_models) -> None:
    """The gateway names core.serving_engine.ServingEngine, never the class: the engine must keep that face."""
    from tandem.core.serving_engine import ServingEngine

    target, draft, _ = tiny_models
    engine = build_engine(target, draft, FIXED_K)
    members = set(ServingEngine.__annotations__) | {name for name in vars(ServingEngine) if not name.startswith("_")}
    assert {"add_request", "step", "sequence", "max_batch", "verifier"} <= members
    assert [name for name in sorted(members) if not hasattr(engine, name)] == []
    request_id = engine.add_request(PROMPT, _greedy())
    assert engine.sequence(request_id).request_id == request_id and engine.max_batch == engine.config.max_batch
