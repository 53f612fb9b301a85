"""Prompt lookup: drafts copied from a request's own context where its output repeats it, chosen per round against
the draft model's, with the output exactly what it is without them (greedy, seeded and unseeded sampling)."""

from __future__ import annotations

import dataclasses

import pytest

from gateway_harness import ServerThread, openai_sdk, tiny_backend
from marginals import assert_second_tokens_follow, two_token_marginals
from tandem.client import TandemClient
from tandem.core import policy
from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.core.costs import CostModel
from tandem.core.prompt_lookup import PACE_DECAY, PRIOR_ACCEPTANCE, LookupAcceptance, Pace, PromptLookup
from tandem.core.round_plan import RowView, plan_round
from tandem.engines.local import build_engine
from telemetry_helpers import scrape, value

LOOKUP = SpecConfig(prompt_lookup=True)
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119] * 4  # its last tokens occur earlier in it: a lookup from the start


def _flat_costs(draft_step: float = 0.1) -> CostModel:
    """Every forward of up to 9 tokens costs the same and nothing is measured in service (a tiny model's timings on
    a loaded machine would decide otherwise run to run)."""
    return CostModel(draft_step=draft_step, verify={w: 1.0 for w in range(1, 10)}, frozen=True)


def _run(engine, params: SamplingParams, prompt: list[int]):
    request_id = engine.add_request(prompt, params)
    seq = engine.sequence(request_id)
    while engine.has_unfinished():
        engine.step()
    return engine.result(seq)


def test_offers_what_followed_the_latest_earlier_occurrence() -> None:
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 10]
    lookup = PromptLookup(prompt)
    assert lookup.offer([], 5) == []  # "3 10" occurs nowhere before
    assert lookup.offer([4, 5], 5) == [6, 7, 8, 9, 2]  # "4 5" at 3-4
    assert lookup.offer([4, 5, 6, 7], 5) == [8, 9, 2, 3, 10]  # a copy going on
    assert lookup.offer([4, 5, 6, 7], 0) == []
    # A unigram is not enough: 9 occurs before, "7 9" does not.
    assert lookup.offer([4, 5, 6, 7, 9], 5) == []
    # The longest run first: "2 3" occurs twice; "1 2 3" only at the start, so the copy goes on from there.
    again = [*prompt, 50, 1]
    lookup = PromptLookup(again)
    assert lookup.offer([2, 3], 3) == [4, 5, 6]
    # Else the latest occurrence, which may be in the output itself; and never past what the context holds.
    lookup = PromptLookup([7, 8, 20])
    assert lookup.offer([7, 8, 21, 7, 8], 4) == [21, 7, 8]


def test_an_offer_knows_how_far_back_its_match_goes() -> None:
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 10]
    lookup = PromptLookup(prompt)
    lookup.offer([4, 5], 5)
    assert lookup.matched == 2  # "4 5", then 3 against 10
    lookup.offer([4, 5, 6, 7], 5)
    assert lookup.matched == 4  # the copy went on: "4 5 6 7"
    long = list(range(100, 140))
    lookup = PromptLookup(long + [0] + long[:30])
    lookup.offer([], 4)
    assert lookup.matched == 16  # measured up to the longest class's length


def test_looked_up_acceptance_is_learnt_per_match_length_and_fades() -> None:
    now = [0.0]
    acceptance = LookupAcceptance(clock=lambda: now[0])
    assert [acceptance.class_of(n) for n in (2, 3, 4, 7, 8, 15, 16, 40)] == [0, 1, 2, 2, 3, 3, 4, 4]
    for _ in range(10):
        acceptance.observe(2, 6, 0)  # two-token matches refused at once
        acceptance.observe(12, 8, 8)  # long ones accepted whole
    assert acceptance.value(2) < 0.2 and acceptance.value(3) == pytest.approx(PRIOR_ACCEPTANCE)
    assert acceptance.value(9) > 0.95
    now[0] += 3600.0  # an hour without rounds of its class: back near the prior, so it is tried again
    assert acceptance.value(2) == pytest.approx(PRIOR_ACCEPTANCE, abs=0.01)


def test_the_context_grows_past_its_first_capacity() -> None:
    prompt = [5, 6]
    lookup = PromptLookup(prompt)
    output = list(range(100, 300)) + [100, 101]
    assert lookup.offer(output, 3) == [102, 103, 104]


def test_the_round_plan_drafts_looked_up_tokens_where_they_beat_the_draft_model() -> None:
    costs = _flat_costs(draft_step=0.1)

    def row(**kw) -> RowView:
        fields = {"policy": policy.PolicyState(k=4, accepted=40.0, rejected=4.0), "max_k": None, "remaining": 100,
                  "prefill_limit": 0, "first_round": False, "behind": 3, "predicted": 8,
                  "prediction_acceptance": 0.9} | kw
        return RowView(**fields)

    plan = plan_round([row(), row(prediction_acceptance=0.2), row(predicted=0), row(max_k=0)], True, LOOKUP,
                      costs, 0.8)
    assert plan.from_prediction(0) and plan.ks[0] == 8 and plan.decisions[0] is None
    # Looked-up drafts accepted a fifth of the time lose to the draft model's (about 0.9 here): the policy decides.
    assert not plan.from_prediction(1) and plan.decisions[1] is not None and plan.ks[1] > 0
    assert not plan.from_prediction(2) and plan.decisions[2] is not None
    assert plan.ks[3] == 0 and not plan.from_prediction(3)  # max_k 0: plain decoding
    # A drafter far behind (it missed a copy's tokens) would first catch up: weaker looked-up drafts win then.
    near, far = plan_round([row(prediction_acceptance=0.4), row(prediction_acceptance=0.4, behind=60)], True,
                           LOOKUP, costs, 0.8).predicted
    assert not near and far
    # Without a draft model, looked-up drafts are weighed against plain decoding alone.
    assert plan_round([row(prediction_acceptance=0.2)], False, LOOKUP, costs, 0.8).ks == (8,)
    steep = CostModel(verify={1: 1.0, 2: 2.0, 3: 3.0}, frozen=True)
    assert plan_round([row(prediction_acceptance=0.3, predicted=2)], False, LOOKUP, steep, 0.8).ks == (0,)


def test_a_pace_is_recent_tokens_over_priced_seconds() -> None:
    pace = Pace()
    assert pace.rate == 0.0
    pace.record(9, 1.0)
    assert pace.rate == 9.0
    pace.record(1, 0.5)
    assert pace.rate == pytest.approx((9 * PACE_DECAY + 1) / (PACE_DECAY + 0.5))


def test_the_draft_model_drafts_only_where_it_keeps_the_rows_pace() -> None:
    """A round with no copy on offer: at plain decoding's pace (or with none measured) the draft model drafts as its
    policy says; at a copying pace the tokens its drafts would add are worth less than its steps, so the row decodes
    plainly, its policy not asked; a fixed k drafts as given, and so does a probe out of fallback (held back, it would
    be asked again every round). A weak copy on offer loses to the draft model at a plain pace, and is taken at a
    copying pace, where it beats the plain decoding left."""
    costs = _flat_costs(draft_step=0.1)  # a plain round 1 s, a round of 8 drafts 1.8 s
    row = RowView(policy.PolicyState(k=4, accepted=40.0, rejected=4.0), None, 100, 0, False, behind=1, predicted=0)

    def plan(pace: float, spec: SpecConfig = LOOKUP, **offer):
        return plan_round([dataclasses.replace(row, pace=pace, **offer)], True, spec, costs, 0.9)

    for pace in (0.0, 1.0, 2.0):
        assert plan(pace).ks[0] > 1 and plan(pace).decisions[0] is not None
    assert plan(10.0).ks == (0,) and plan(10.0).decisions == (None,)
    assert plan(10.0, dataclasses.replace(LOOKUP, adaptive=False)).ks == (LOOKUP.k_init,)
    probe = policy.PolicyState(k=0, accepted=40.0, rejected=4.0, fallback=True, rounds_since_probe=7,
                               probe_interval=8)
    probing = plan_round([dataclasses.replace(row, policy=probe, pace=10.0)], True, LOOKUP, costs, 0.9)
    assert probing.decisions[0].probing and probing.ks[0] > 0
    weak = {"predicted": 8, "prediction_acceptance": 0.4}
    assert not plan(1.0, **weak).from_prediction(0) and plan(1.0, **weak).decisions[0] is not None
    assert plan(10.0, **weak).from_prediction(0) and plan(10.0, **weak).ks == (8,)


def test_in_a_batch_a_looked_up_block_is_kept_where_it_raises_the_batchs_rate() -> None:
    """Alone, where every width costs the same, any looked-up block pays; beside 7 rows decoding plainly, whose
    forward it widens, a block that would almost all be refused costs them more than it brings and is dropped, a
    likely one is kept whole, a weak one kept short."""
    costs = CostModel(draft_step=0.1, verify={w: 1.0 for w in range(1, 10)},
                      batched={(8, w): 1.0 + 0.02 * (w - 1) for w in (1, 2, 3, 5)}, frozen=True)
    plain = RowView(policy.PolicyState(), 0, 100, 0, False, behind=0)  # max_k 0: it decodes plainly

    def plan(acceptance: float, mates: int = 7):
        row = dataclasses.replace(plain, max_k=None, predicted=8, prediction_acceptance=acceptance)
        return plan_round([row] + [plain] * mates, False, LOOKUP, costs, 0.8)

    assert plan(0.05, mates=0).ks == (8,)
    assert plan(0.05).ks == (0,) * 8 and not plan(0.05).from_prediction(0)
    assert plan(0.95).ks[0] == 8 and plan(0.95).from_prediction(0)
    assert 0 < plan(0.3).ks[0] < 8 and plan(0.3).ks[1:] == (0,) * 7


def test_each_round_is_priced_into_the_rows_pace(tiny_models) -> None:
    """Flat costs price every round at one second: a row's pace is its recent tokens a round, above 1 where copies
    were accepted; a row that never looks up keeps none."""
    target, _, _ = tiny_models
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for spec in (LOOKUP, SpecConfig()):
        engine = build_engine(target, None, EngineConfig(spec=spec, calibrate=False), costs=_flat_costs())
        seq = engine.sequence(engine.add_request(PROMPT, params))
        while engine.has_unfinished():
            engine.step()
        if spec.prompt_lookup:
            assert seq.stats.lookup_accepted > 0 and seq.pace.rate > 1.0
        else:
            assert seq.pace is None


@pytest.mark.parametrize("with_draft", [False, True], ids=["target-only", "with-draft-model"])
def test_greedy_output_is_the_same_with_lookup(tiny_models, with_draft: bool) -> None:
    """A prompt that repeats itself, so the lookup finds runs to copy: the output is plain decoding's either way."""
    target, draft, _ = tiny_models
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    base = build_engine(target, None, EngineConfig(calibrate=False), costs=_flat_costs())
    costs = _flat_costs(draft_step=0.5)  # dear drafts: looked-up ones win wherever the lookup finds a run
    engine = build_engine(target, draft if with_draft else None, EngineConfig(spec=LOOKUP, calibrate=False),
                          costs=costs)
    looked_up = 0
    for start in range(4):
        prompt = [(start + i) % 23 + 40 for i in range(30)] * 3
        plain = _run(base, params, prompt)
        out = _run(engine, params, prompt)
        assert out.token_ids == plain.token_ids
        looked_up += out.stats["accepted_lookup_tokens"]
        assert out.stats["accepted_prediction_tokens"] == 0  # OpenAI's prediction counts are the client's alone
    assert looked_up > 0


def test_seeded_output_is_the_same_with_lookup(tiny_models) -> None:
    target, draft, _ = tiny_models
    base = build_engine(target, draft, EngineConfig(calibrate=False), costs=_flat_costs())
    engine = build_engine(target, draft, EngineConfig(spec=LOOKUP, calibrate=False), costs=_flat_costs(0.5))
    rounds = 0
    for seed in range(4):
        params = SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_tokens=40, ignore_eos=True)
        plain = _run(base, params, PROMPT)
        out = _run(engine, params, PROMPT)
        assert out.token_ids == plain.token_ids
        rounds += out.stats["lookup_rounds"]
    assert rounds > 0


def test_unseeded_sampled_output_follows_the_target_distribution(tiny_models) -> None:
    """Second-token marginal over 3000 runs of a prompt whose last tokens occur earlier in it, so the first round
    drafts what followed them there: accepted with probability p(token), resampled from p without it otherwise."""
    target, _, _ = tiny_models
    params = [SamplingParams(temperature=0.9, top_k=12, top_p=0.95, max_tokens=2, ignore_eos=True)
              for _ in range(3000)]
    p_first, support, p_second = two_token_marginals(target.model, PROMPT, params[0])
    config = EngineConfig(spec=dataclasses.replace(LOOKUP, plain_first_round=False), max_batch=500, calibrate=False)
    engine = build_engine(target, None, config, costs=_flat_costs())
    for sampled in params:
        engine.add_request(PROMPT, sampled)
    sequences = list(engine.sequences.values())
    while engine.has_unfinished():
        engine.step()
    results = [engine.result(seq) for seq in sequences]
    assert sum(r.stats["lookup_rounds"] for r in results) >= 3000
    assert_second_tokens_follow(results, p_first, support, p_second)


def test_served_lookup_counts_reach_grpc_http_and_metrics(tiny_models) -> None:
    """A gateway whose engine looks up drafts: gRPC's SpeculationStats and HTTP's `tandem.speculation` carry the
    looked-up rounds and tokens, OpenAI's prediction counts stay 0, and the metrics count the same tokens."""
    target, draft, _ = tiny_models
    server = ServerThread(tiny_backend(target, draft, prompt_lookup=True), http_port=0, metrics_port=0)
    try:
        with TandemClient(server.address, timeout=60) as client:
            result = client.generate_result(token_ids=PROMPT, temperature=0.0, max_tokens=24, ignore_eos=True)
        sdk = openai_sdk(server)
        completion = sdk.completions.create(model="tiny-target", prompt=PROMPT, temperature=0, max_tokens=24,
                                            extra_body={"ignore_eos": True})
        assert server.wait_for(lambda: server.gateway.loop.active == 0)
        families = scrape(server.gateway.metrics_url)
    finally:
        server.stop()
    stats = completion.choices[0].model_extra["tandem"]["speculation"]
    assert result.speculation.lookup_rounds == stats["lookup_rounds"] > 0
    assert result.speculation.accepted_lookup_tokens == stats["accepted_lookup_tokens"]
    assert result.speculation.rejected_lookup_tokens == stats["rejected_lookup_tokens"]
    assert completion.usage.completion_tokens_details.accepted_prediction_tokens == 0
    for outcome in ("accepted", "rejected"):
        assert value(families, "tandem_spec_lookup_tokens_total", tandem_spec_outcome=outcome) == 2 * stats[
            f"{outcome}_lookup_tokens"]
    assert value(families, "tandem_spec_rounds_total", tandem_spec_round_kind="lookup") == 2 * stats["lookup_rounds"]
