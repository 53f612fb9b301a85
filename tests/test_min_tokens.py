"""min_tokens (vLLM's): no token that would end the output before it, held back on draft and target alike, so that
speculation stays lossless (greedy, seeded and unseeded sampling), through the engine and the OpenAI API."""

from __future__ import annotations

import httpx
import pytest
import torch

from marginals import assert_second_tokens_follow
from tandem.core.config import EngineConfig, OutputFormat, SamplingParams, SpecConfig
from tandem.engines.local import build_engine
from tandem.errors import InvalidArgument

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]


def _engines(tiny_models) -> dict:
    target, draft, _ = tiny_models
    fixed = EngineConfig(spec=SpecConfig(adaptive=False, k_init=4), calibrate=False, max_batch=500)
    return {"plain": build_engine(target, None, EngineConfig(calibrate=False, max_batch=500)),
            "speculative": build_engine(target, draft, fixed)}


def _eos(engine) -> int:
    return min(engine.eos_token_ids)


def test_the_end_is_held_back_until_min_tokens(tiny_models) -> None:
    outputs = {}
    for name, engine in _engines(tiny_models).items():
        eos = _eos(engine)
        eager = SamplingParams(temperature=0.0, max_tokens=30, logit_bias=((eos, 100.0),))
        ended = engine.generate([PROMPT], eager)[0]  # the bias ends it at once (an EOS is not part of the output)
        assert (ended.token_ids, ended.finish_reason) == ([], "stop")
        held = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=30, logit_bias=((eos, 100.0),),
                                                        min_tokens=10))[0]
        assert len(held.token_ids) == 10 and eos not in held.token_ids and held.finish_reason == "stop", name
        stop_id = 50
        by_id = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=(stop_id,),
                                                         logit_bias=((stop_id, 100.0),), min_tokens=5))[0]
        assert len(by_id.token_ids) == 5 and stop_id not in by_id.token_ids and by_id.finish_reason == "stop"
        outputs[name] = (held.token_ids, by_id.token_ids)
    assert outputs["plain"] == outputs["speculative"]


def test_seeded_output_with_min_tokens_is_the_same_speculating_or_not(tiny_models) -> None:
    engines = _engines(tiny_models)
    eos = _eos(engines["plain"])
    params = [SamplingParams(temperature=0.9, seed=seed, max_tokens=24, min_tokens=12, logit_bias=((eos, 4.0),))
              for seed in range(6)]
    plain = [r.token_ids for r in engines["plain"].generate([PROMPT] * 6, params)]
    assert all(len(ids) >= 12 and eos not in ids[:12] for ids in plain)
    assert [r.token_ids for r in engines["speculative"].generate([PROMPT] * 6, params)] == plain


def test_unseeded_sampled_output_follows_the_held_back_distribution(tiny_models) -> None:
    """Second-token marginal over 3000 speculative runs against sum_t p(t) p(. | t), both with the EOS held back."""
    target = tiny_models[0]
    engine = _engines(tiny_models)["speculative"]
    eos = _eos(engine)
    params = SamplingParams(temperature=1.0, top_k=12, max_tokens=3, min_tokens=2, ignore_eos=True,
                            stop_token_ids=(eos,), logit_bias=((eos, 6.0),))
    results = engine.generate([PROMPT] * 3000, params)
    assert sum(r.stats["accepted"] for r in results) > 500
    from tandem.core.sampling import processed_probs

    with torch.inference_mode():
        def probs(logits: torch.Tensor) -> torch.Tensor:
            logits = logits.float().clone()
            logits[:, eos] = float("-inf")
            return processed_probs(logits, params)

        p_first = probs(target.model(torch.tensor([PROMPT])).logits[0, -1:])[0]
        support = p_first.nonzero().flatten()
        p_second = probs(target.model(torch.tensor([PROMPT + [int(t)] for t in support])).logits[:, -1])
    assert p_first[eos] == 0
    assert_second_tokens_follow(results, p_first, support.tolist(), p_second)


def test_min_tokens_is_checked() -> None:
    with pytest.raises(InvalidArgument, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(InvalidArgument, match="min_tokens"):
        SamplingParams(min_tokens=2, output_format=OutputFormat("regex", "a+"))


def test_min_tokens_over_the_openai_api(server, tiny_models) -> None:
    eos = _eos(server.engine)
    body = {"model": "tiny-target", "prompt": "abc", "max_tokens": 20, "temperature": 0, "min_tokens": 8,
            "logit_bias": {str(eos): 100}}
    response = httpx.post(f"{server.gateway.http_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["usage"]["completion_tokens"] == 8 and answer["choices"][0]["finish_reason"] == "stop"


def test_min_tokens_past_the_responses_apis_limit_is_named_in_its_words(server) -> None:
    body = {"model": "tiny-target", "input": "abc", "max_output_tokens": 20, "min_tokens": 500, "store": False}
    response = httpx.post(f"{server.gateway.http_url}/v1/responses", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "min_tokens" and "limit of 20 tokens" in error["message"]
    assert "max_tokens" not in error["message"]  # the Responses API's field is max_output_tokens
