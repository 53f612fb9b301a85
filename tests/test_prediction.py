"""Predicted outputs: a request's expected output drafted where the output matches it, with the output exactly what it
is without the prediction (greedy, seeded and unseeded sampling), through the engine, gRPC and the OpenAI API."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from gateway_harness import ServerThread, openai_sdk
from marginals import assert_second_tokens_follow, two_token_marginals
from tandem.client import TandemClient
from tandem.core import policy
from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.core.costs import CostModel
from tandem.core.prediction import Prediction, predicted_k, predicted_proposal
from tandem.core.round_plan import RowView, plan_round
from tandem.engines import Backend
from tandem.engines.local import build_engine
from tandem.gateway.validate import GatewayLimits
from telemetry_helpers import scrape, value

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]
MODEL = "tiny-target"


def _flat_costs() -> CostModel:
    """Every forward of up to 9 tokens costs the same and nothing is measured in service: drafting predictions
    always pays, whatever the tiny model's timings on a loaded machine."""
    return CostModel(draft_step=0.1, verify={w: 1.0 for w in range(1, 10)}, frozen=True)


def _run(engine, params: SamplingParams, prediction: list[int] | None = None, prompt: list[int] = PROMPT):
    request_id = engine.add_request(prompt, params, prediction=prediction)
    seq = engine.sequence(request_id)
    while engine.has_unfinished():
        engine.step()
    return engine.result(seq)


def test_offers_continue_where_the_output_rejoins_the_prediction() -> None:
    prediction = Prediction([10, 11, 12, 13, 14, 15, 16, 17, 12, 13, 99])
    assert prediction.offer([], 3) == [10, 11, 12]  # the first round: the prediction's start
    assert prediction.offer([10, 11], 4) == [12, 13, 14, 15]
    # An edit: the output wrote 50 51 in place of 13 14, then rejoined the prediction at 15.
    assert prediction.offer([10, 11, 12, 50, 51], 4) == []
    assert prediction.offer([10, 11, 12, 50, 51, 15], 3) == [16, 17, 12]
    # 12 13 occurs twice: the occurrence at or after the last one used is taken.
    assert prediction.offer([10, 11, 12, 50, 51, 15, 16, 17, 12, 13], 5) == [99]
    assert prediction.offer([10, 11, 12, 13, 14, 15, 16, 17, 12, 13, 99], 5) == []  # nothing after its end
    assert prediction.offer([10], 0) == []
    # Inside a run of repeated tokens, the output goes on where it stands, not at the run's first match.
    run = [1, 2, 3, 9, 9, 9, 9, 9, 9, 9, 9, 4, 5, 6]
    repeated = Prediction(run)
    assert repeated.offer([], 4) == run[:4] and repeated.offer(run[:5], 4) == run[5:9]
    assert repeated.offer(run[:9], 4) == [9, 9, 4, 5]


def test_predicted_k_pays_for_what_the_forward_costs() -> None:
    flat = _flat_costs()
    assert predicted_k(6, 0.9, flat) == 6 and predicted_k(0, 0.9, flat) == 0
    steep = CostModel(verify={1: 1.0, 2: 2.0, 3: 3.0}, frozen=True)  # as dear per token as a plain forward
    assert predicted_k(2, 0.5, steep) == 0
    # Widths past those timed are priced as the widest timed (a target-only engine times only width 1 at first).
    assert predicted_k(5, 0.5, CostModel(verify={1: 1.0}, frozen=True)) == 5


def test_the_round_plan_drafts_predictions_without_the_policy() -> None:
    spec, costs = SpecConfig(), _flat_costs()

    def row(**kw) -> RowView:
        fields = {"policy": policy.PolicyState(k=4), "max_k": None, "remaining": 100, "prefill_limit": 0,
                  "first_round": False, "behind": 3, "predicting": True, "predicted": 12,
                  "prediction_acceptance": 0.9} | kw
        return RowView(**fields)

    plan = plan_round([row(), row(predicted=0), row(max_k=0), row(prefill_limit=64), row(remaining=3),
                       row(predicting=False, predicted=0)], True, spec, costs, 0.8)
    assert plan.ks[0] == spec.k_max and plan.decisions[0] is None and plan.from_prediction(0)
    assert plan.catch_up[0] == 0  # its drafter neither drafts nor catches up
    # No offer: plain decoding, the draft model not asked (its drafter is behind by every predicted token).
    assert (plan.ks[1], plan.decisions[1], plan.catch_up[1], plan.from_prediction(1)) == (0, None, 0, False)
    assert plan.decisions[5] is not None and plan.ks[5] > 0  # a row without a prediction: its policy decides
    assert plan.ks[2] == 0 and not plan.from_prediction(2)  # max_k 0: plain decoding, predictions too
    assert not plan.from_prediction(3)  # only a chunk of its prompt this step
    assert plan.ks[4] == 2 and plan.from_prediction(4)  # never past the tokens left (the last is the target's)
    # Not speculating (no drafter): predictions still draft.
    assert plan_round([row()], False, spec, costs, 0.8).ks == (spec.k_max,)
    # A fixed k drafts as given: all that is offered within it, whatever the costs say.
    steep = CostModel(verify={1: 1.0, 2: 2.0, 3: 3.0}, frozen=True)
    fixed = SpecConfig(adaptive=False, k_max=3, k_init=3)
    assert plan_round([row(), row(predicted=2)], True, fixed, steep, 0.8).ks == (3, 2)
    assert plan_round([row(prediction_acceptance=0.3)], True, spec, steep, 0.8).ks == (0,)  # adaptive: priced


def test_a_sampled_proposal_carries_a_one_hot_q() -> None:
    proposal = predicted_proposal([5, 9], sampled=True)
    assert proposal.dist.ids.tolist() == [[5], [9]] and proposal.dist.probs.tolist() == [[1.0], [1.0]]
    assert predicted_proposal([5, 9], sampled=False).dist is None


@pytest.mark.parametrize("with_draft", [False, True], ids=["target-only", "with-draft-model"])
def test_greedy_output_is_the_same_with_any_prediction(tiny_models, with_draft: bool) -> None:
    target, draft, _ = tiny_models
    engine = build_engine(target, draft if with_draft else None, EngineConfig(calibrate=False), costs=_flat_costs())
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    plain = _run(engine, params).token_ids
    edited = plain[:20] + [5, 6, 7] + plain[25:]
    exact = _run(engine, params, plain)
    assert exact.token_ids == plain
    # The whole prediction taken: 60 tokens in 7 target forwards of 8 drafts and the target's own token each.
    assert exact.stats["accepted_prediction_tokens"] == 53 and exact.stats["rejected_prediction_tokens"] == 0
    assert exact.stats["rounds"] == exact.stats["predicted_rounds"] == 7 and exact.stats["drafted"] == 0
    rejoined = _run(engine, params, edited)
    assert rejoined.token_ids == plain
    assert rejoined.stats["accepted_prediction_tokens"] >= 40  # before the edit, and after the output rejoins it
    assert rejoined.stats["rejected_prediction_tokens"] > 0
    junk = _run(engine, params, list(range(100, 160)))
    assert junk.token_ids == plain and junk.stats["accepted_prediction_tokens"] == 0
    # A stop inside the accepted drafts ends the output there: only what it holds is counted.
    stop_id = plain[12]
    stopped = _run(engine, dataclasses.replace(params, stop_token_ids=(stop_id,)), plain)
    assert stopped.token_ids == plain[: plain.index(stop_id)]
    assert 0 < stopped.stats["accepted_prediction_tokens"] <= len(stopped.token_ids)
    assert stopped.stats["rejected_prediction_tokens"] == 0


def test_seeded_output_is_the_same_with_a_prediction(tiny_models) -> None:
    target, draft, _ = tiny_models
    engine = build_engine(target, draft, EngineConfig(calibrate=False), costs=_flat_costs())
    for seed in range(4):
        params = SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_tokens=40, ignore_eos=True)
        plain = _run(engine, params).token_ids
        predicted = _run(engine, params, plain[:15] + [3, 4] + plain[17:])
        assert predicted.token_ids == plain
        assert predicted.stats["accepted_prediction_tokens"] > 10


def test_unseeded_sampled_output_follows_the_target_distribution(tiny_models) -> None:
    """Second-token marginal over 3000 runs, each predicting the two most likely tokens: accepted with
    probability p(token), resampled from p without it otherwise (min(1, p/q) with q one-hot)."""
    target, _, _ = tiny_models
    params = [SamplingParams(temperature=0.9, top_k=12, top_p=0.95, max_tokens=2, ignore_eos=True)
              for _ in range(3000)]
    p_first, support, p_second = two_token_marginals(target.model, PROMPT, params[0])
    first = int(p_first.argmax())
    second = int(p_second[support.index(first)].argmax())
    engine = build_engine(target, None, EngineConfig(max_batch=500, calibrate=False), costs=_flat_costs())
    for sampled in params:
        engine.add_request(PROMPT, sampled, prediction=[first, second])
    sequences = list(engine.sequences.values())
    while engine.has_unfinished():
        engine.step()
    results = [engine.result(seq) for seq in sequences]
    assert sum(r.stats["accepted_prediction_tokens"] for r in results) > 500
    assert_second_tokens_follow(results, p_first, support, p_second)


def test_predicted_and_model_drafted_rows_share_a_round(tiny_models) -> None:
    """Sampled rows, one drafting its prediction (a one-hot q) beside one the draft model drafts for (its top-m q),
    verified in the same forwards: each gives what it gives alone."""
    target, draft, _ = tiny_models
    engine = build_engine(target, draft, EngineConfig(spec=SpecConfig(adaptive=False, k_init=4), calibrate=False),
                          costs=_flat_costs())
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=30, ignore_eos=True)
    alone = _run(engine, seeded).token_ids
    unseeded = SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True)
    first = engine.add_request(PROMPT, seeded, prediction=alone)
    second = engine.add_request(PROMPT[:5], unseeded)
    sequences = [engine.sequence(first), engine.sequence(second)]
    while engine.has_unfinished():
        engine.step()
    predicted, drafted = (engine.result(seq) for seq in sequences)
    assert predicted.token_ids == alone and predicted.stats["accepted_prediction_tokens"] > 15
    assert len(drafted.token_ids) == 30 and drafted.stats["drafted"] > 0 and drafted.stats["predicted_rounds"] == 0
    assert predicted.stats["drafted"] == 0  # the draft model never drafts for a row with a prediction


def test_a_prediction_outside_the_vocabulary_is_refused(tiny_models) -> None:
    engine = build_engine(tiny_models[0], None, EngineConfig(calibrate=False))
    with pytest.raises(ValueError, match="prediction"):
        engine.add_request(PROMPT, SamplingParams(max_tokens=4), prediction=[10**7])


@pytest.fixture(scope="module")
def server(tiny_models):
    """A gateway over the tiny pair whose engine prices forwards flat (_flat_costs): how many predicted tokens a round
    drafts depends on the prediction alone."""
    target, draft, _ = tiny_models

    def load() -> Backend:
        engine = build_engine(target, draft, EngineConfig(calibrate=False), costs=_flat_costs())
        return Backend(engine, target.tokenizer, MODEL, "tiny-draft")

    running = ServerThread(load, http_port=0, limits=GatewayLimits(max_prompt_tokens=512), metrics_port=0)
    yield running
    running.stop()


CHAT = [{"role": "user", "content": "rename x to y: def f(x): return x + 1"}]


def test_chat_prediction_over_http_and_grpc(server: ServerThread) -> None:
    """The tiny model's output is mostly bytes of no valid UTF-8, which its text does not give back: the prediction
    (that text) re-encodes to other tokens in part, and only that part is accepted."""
    before = scrape(server.gateway.metrics_url)
    sdk = openai_sdk(server)
    greedy = {"model": MODEL, "messages": CHAT, "temperature": 0, "max_tokens": 48,
              "extra_body": {"ignore_eos": True}}
    plain = sdk.chat.completions.create(**greedy)
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    predicted = sdk.chat.completions.create(**greedy, prediction={"type": "content", "content": text})
    assert predicted.choices[0].message.content == text
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens > 0, details
    assert predicted.choices[0].model_extra["tandem"]["speculation"]["predicted_rounds"] > 0
    parts = [{"type": "text", "text": text[:10]}, {"type": "text", "text": text[10:]}]
    again = sdk.chat.completions.create(**greedy, prediction={"type": "content", "content": parts})
    assert again.choices[0].message.content == text and again.usage.completion_tokens_details.accepted_prediction_tokens
    with TandemClient(server.address, timeout=60) as client:
        result = client.generate_result(chat=[(m["role"], m["content"]) for m in CHAT], temperature=0.0,
                                        max_tokens=48, ignore_eos=True, prediction=text)
    assert result.text == text
    assert (result.usage.accepted_prediction_tokens, result.usage.rejected_prediction_tokens) == (
        details.accepted_prediction_tokens, details.rejected_prediction_tokens)
    assert server.wait_for(lambda: server.gateway.loop.active == 0)
    after = scrape(server.gateway.metrics_url)

    def delta(sample: str, **labels) -> float:
        return value(after, sample, **labels) - value(before, sample, **labels)

    usages = [predicted.usage.completion_tokens_details, again.usage.completion_tokens_details, result.usage]
    for outcome in ("accepted", "rejected"):
        assert delta("tandem_spec_prediction_tokens_total", tandem_spec_outcome=outcome) == sum(
            getattr(usage, f"{outcome}_prediction_tokens") for usage in usages)
    assert delta("tandem_spec_rounds_total", tandem_spec_round_kind="predicted") >= 3


def test_completion_and_response_predictions(server: ServerThread) -> None:
    """OpenAI takes a prediction on chat completions only; tandem takes it on completions and the Responses API too,
    with the same output and the same accounting (completions: usage's completion_tokens_details; responses: the
    tandem.speculation stats)."""
    sdk = openai_sdk(server)
    greedy = {"model": MODEL, "prompt": "def f(x): return x + 1", "temperature": 0, "max_tokens": 48}
    plain = sdk.completions.create(**greedy, extra_body={"ignore_eos": True})
    text = plain.choices[0].text
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    predicted = sdk.completions.create(**greedy, extra_body={"ignore_eos": True,
                                                             "prediction": {"type": "content", "content": text}})
    assert predicted.choices[0].text == text
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0, details
    turn = {"model": MODEL, "input": CHAT[0]["content"], "temperature": 0, "max_output_tokens": 32, "store": False}
    answer = sdk.responses.create(**turn, extra_body={"ignore_eos": True})
    assert answer.model_extra["tandem"]["speculation"].get("accepted_prediction_tokens", 0) == 0
    again = sdk.responses.create(**turn, extra_body={"ignore_eos": True, "prediction": {
        "type": "content", "content": [{"type": "text", "text": answer.output_text}]}})
    assert again.output_text == answer.output_text
    assert again.model_extra["tandem"]["speculation"]["accepted_prediction_tokens"] > 0


@pytest.mark.parametrize(("prediction", "param"), [
    ({"type": "audio", "content": "x"}, "prediction.type"),
    ({"type": "content", "content": [{"type": "image_url", "text": None}]}, "prediction.content"),
    ({"type": "content", "content": [{"type": "text"}]}, "prediction.content: a text part needs its text"),
])
def test_a_malformed_prediction_is_a_400_naming_it(server: ServerThread, prediction: dict, param: str) -> None:
    response = httpx.post(f"{server.gateway.http_url}/v1/chat/completions", timeout=30,
                          json={"model": MODEL, "messages": CHAT, "max_tokens": 4, "prediction": prediction})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param.split(":")[0] and error["message"].startswith(param)
