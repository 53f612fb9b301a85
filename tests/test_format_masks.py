"""Response formats in the core: each verified position masked as plain decoding masks it, drafts walked and rolled
back, outputs that match, and speculation that stays lossless under a format."""

from __future__ import annotations

import json
import re

import pytest
import torch
from jsonschema import validate

from gateway_harness import ServerThread, tiny_backend
from marginals import assert_second_tokens_follow
from tandem.core import format_masks, formats
from tandem.core.config import EngineConfig, OutputFormat, SamplingParams, SpecConfig
from tandem.core.engine import SpeculativeEngine
from tandem.core.format_masks import FormatMasks
from tandem.core.formats import build_in_background
from tandem.core.local import LocalDrafter, LocalVerifier
from tandem.core.protocol import DraftRequest
from tandem.core.runner import ModelRunner
from tandem.core.sequence import SequenceState
from tandem.engines.local import build_engine
from tandem.errors import InvalidArgument, RequestRefused

pytestmark = pytest.mark.xdist_group("format_masks")
FIXED_K = EngineConfig(spec=SpecConfig(adaptive=False, k_init=3), calibrate=False)
# Bounded, and with at most one space between JSON tokens: a random-weight model fills whatever room a format leaves.
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "tag"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tag": {"type": "string", "enum": ["red", "green", "blue"]}},
          "x-guidance": {"whitespace_pattern": "[ ]{0,1}"}}
JSON_FORMAT = OutputFormat("json_schema", json.dumps(SCHEMA))
REGEX = "(a[0-3]|b[4-7]|c[89])x(yz)?"
REGEX_FORMAT = OutputFormat("regex", REGEX)
# REGEX's language as a client's grammar, in llama.cpp's GBNF and in llguidance's Lark.
GBNF_FORMAT = OutputFormat("grammar", 'root ::= ("a" [0-3] | "b" [4-7] | "c" [89]) "x" ("yz")?')
LARK_FORMAT = OutputFormat("grammar", 'start: head "x" "yz"?\nhead: "a" /[0-3]/ | "b" /[4-7]/ | "c" /[89]/')


def _prompts(count: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(0, 256, (int(n),), generator=generator).tolist()
            for n in torch.randint(2, 20, (count,), generator=generator)]


def _text(target, ids: list[int]) -> str:
    return target.tokenizer.decode(ids, skip_special_tokens=True)


def _ids(target, text: str) -> list[int]:
    return target.tokenizer.encode(text, add_special_tokens=False)


def _allowed(logits: torch.Tensor) -> set[int]:
    return set(torch.isfinite(logits).nonzero().flatten().tolist())


@pytest.mark.parametrize("parallel", [False, True], ids=["one-row-after-another", "llguidance-threads"])
def test_each_position_is_masked_after_the_drafts_before_it(tiny_models, parallel: bool) -> None:
    """A hand-worked walk over the byte vocabulary: position i allows what the format allows after the output and
    drafts[:i]; the walk stops at the first draft the format refuses, or past an EOS (later positions left as they
    were); a later call rolls the rejected draft back; rows without a format and the raw logits are untouched. Both
    ways of computing a step's masks (a CPU's, a GPU's) alike."""
    target = tiny_models[0]
    eos = target.tokenizer.eos_token_id
    masks = FormatMasks(target.tokenizer, {eos}, parallel=parallel)
    a, b, c, d, e, x = _ids(target, "abcdex")
    formatted = DraftRequest("s", keep=0, append=[], k=0, params=SamplingParams(output_format=OutputFormat(
        "regex", "ab(c|d)e")), output_start=2)
    free = DraftRequest("t", keep=0, append=[], k=0, params=SamplingParams())
    state = SequenceState(tokens=[7, 8, a, b, x])  # prompt 7 8, output "a", drafts "b" and "x"
    other = SequenceState(tokens=[9])
    raw = torch.randn(3 + 2, 320)
    before = raw.clone()
    logits = masks.apply(raw, [3, 2], [formatted, free], [state, other], [3, 1], [[b, x], [5]])
    assert torch.equal(raw, before)  # the model's own logits stay for the logprobs
    assert _allowed(logits[0]) == {b}
    assert _allowed(logits[1]) == {c, d}
    assert torch.equal(logits[2], raw[2]) and torch.equal(logits[3:], raw[3:])  # past the refused "x"; the free row
    # The verifier accepted "b" and resampled "d" where "x" was: the matcher follows the output, then allows "e".
    state = SequenceState(tokens=[7, 8, a, b, d])
    logits = masks.apply(torch.randn(1, 320), [1], [formatted], [state], [5], [[]])
    assert _allowed(logits[0]) == {e}
    # "c" instead of the rolled-back "d", then the whole match: only the EOS may follow, and nothing past it is
    # masked.
    state = SequenceState(tokens=[7, 8, a, b, c, e, eos, x])
    raw = torch.randn(3, 320)
    logits = masks.apply(raw, [3], [formatted], [state], [6], [[eos, x]])
    assert _allowed(logits[0]) == {eos} and torch.equal(logits[1:], raw[1:])
    masks.keep_only({"other"})
    assert len(masks) == 0


def test_a_verifier_without_masks_refuses_a_format(tiny_models) -> None:
    engine = SpeculativeEngine(LocalVerifier(ModelRunner(tiny_models[0].model)), None, FIXED_K)
    engine.add_request([4, 5, 6], SamplingParams(temperature=0.0))
    formatted = engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, output_format=REGEX_FORMAT))
    with pytest.raises(RequestRefused, match="cannot follow a response format") as refused:
        engine.step()
    assert refused.value.request_id == formatted


# Ambiguous: its parse costs more with every "a" (86 ms a token after 160 on CPU-A, measured with the real vocabulary).
SLOW_GRAMMAR = OutputFormat("grammar", 'start: e "!"\ne: e e | e e e | "a"')


@pytest.mark.parametrize("parallel", [False, True], ids=["one-row-after-another", "llguidance-threads"])
def test_a_format_that_costs_too_much_or_fails_refuses_its_own_row(tiny_models, parallel: bool) -> None:
    """A row whose masks take longer than the budget, or whose parser hits its limits, is refused by name (its
    matcher dropped); a row with a cheap format beside it is masked as ever."""
    target = tiny_models[0]
    eos = target.tokenizer.eos_token_id
    (a,) = _ids(target, "a")
    slow = DraftRequest("slow", keep=0, append=[], k=0, params=SamplingParams(output_format=SLOW_GRAMMAR),
                        output_start=1)
    cheap = DraftRequest("cheap", keep=0, append=[], k=0, params=SamplingParams(output_format=REGEX_FORMAT),
                         output_start=1)
    states = [SequenceState(tokens=[7] + [a] * 40), SequenceState(tokens=[9])]
    masks = FormatMasks(target.tokenizer, {eos}, parallel=parallel, row_budget_s=0.0, token_budget_s=0.0)
    with pytest.raises(RequestRefused, match=r"^response_format: following the format took") as refused:
        masks.apply(torch.randn(2, 320), [1, 1], [slow, cheap], states, [41, 1], [[], []])
    assert refused.value.request_id == "slow" and len(masks) == 1  # the cheap row's matcher stays
    generous = FormatMasks(target.tokenizer, {eos}, parallel=parallel)
    logits = generous.apply(torch.randn(2, 320), [1, 1], [slow, cheap], states, [41, 1], [[], []])
    assert _allowed(logits[0]) == {a, _ids(target, "!")[0]} and _allowed(logits[1]) == set(_ids(target, "abc"))
    # An output that has left the format (a token it refuses: never emitted, only a drafter's row holds one) is no
    # failure: its positions are left as they are.
    left = DraftRequest("left", keep=0, append=[], k=0, params=SamplingParams(output_format=REGEX_FORMAT),
                        output_start=1)
    logits = generous.apply(torch.randn(1, 320), [1], [left], [SequenceState(tokens=[7, a, a])], [3], [[]])
    assert torch.isfinite(logits).all()


def test_a_format_that_allows_nothing_is_refused_in_one_line(tiny_models) -> None:
    """A schema that is only a reference to itself compiles but allows no token: the refusal carried llguidance's
    whole parser state (its internals and this server's whitespace pattern), 700 characters of it."""
    target = tiny_models[0]
    itself = OutputFormat("json_schema", '{"$ref": "#"}')
    row = DraftRequest("self", keep=0, append=[], k=0, params=SamplingParams(output_format=itself), output_start=1)
    masks = FormatMasks(target.tokenizer, {target.tokenizer.eos_token_id})
    with pytest.raises(RequestRefused) as refused:
        masks.apply(torch.randn(1, 320), [1], [row], [SequenceState(tokens=[7])], [1], [[]])
    assert str(refused.value) == ("response_format: the format failed on this output: NoExtensionBias (the format "
                                  "allows no token here)")


@pytest.mark.parametrize("fields", [{"kind": "xml", "spec": "x"}, {"kind": "regex", "spec": ""},
                                    {"kind": "json_schema", "spec": "{"}, {"kind": "json_schema", "spec": "[1]"}])
def test_bad_formats_are_refused(fields: dict) -> None:
    with pytest.raises(InvalidArgument, match=r"^response_format: "):
        OutputFormat(**fields)


def test_a_format_cannot_ignore_the_eos() -> None:
    with pytest.raises(InvalidArgument, match=r"^ignore_eos: "):
        SamplingParams(ignore_eos=True, output_format=REGEX_FORMAT)


@pytest.mark.parametrize("output_format", [JSON_FORMAT, REGEX_FORMAT, GBNF_FORMAT, LARK_FORMAT],
                         ids=["json-schema", "regex", "gbnf", "lark"])
def test_greedy_formatted_outputs_match_and_equal_plain_decoding(tiny_models, output_format) -> None:
    """Greedy, float32: speculation (k 3, batched with rows that have no format) gives plain decoding's tokens, and
    every output is a whole match ending at the EOS (the random model alone never writes one)."""
    target, draft, _ = tiny_models
    prompts = _prompts(6)
    params = [SamplingParams(temperature=0.0, max_tokens=96, output_format=output_format if i % 3 else None)
              for i in range(len(prompts))]
    plain = build_engine(target, None).generate(prompts, params)
    speculated = build_engine(target, draft, FIXED_K).generate(prompts, params)
    assert [r.token_ids for r in speculated] == [r.token_ids for r in plain]
    assert sum(r.stats["drafted"] for r in speculated) > 0
    for result, request in zip(plain, params, strict=True):
        text = _text(target, result.token_ids)
        if request.output_format is None:
            assert not re.fullmatch(REGEX, text)
            continue
        assert result.finish_reason == "stop"
        if output_format is JSON_FORMAT:
            validate(json.loads(text), SCHEMA)
        else:
            assert re.fullmatch(REGEX, text)


def test_seeded_formatted_tokens_are_the_same_with_speculation_on_and_off(tiny_models) -> None:
    target, draft, _ = tiny_models
    prompts = _prompts(6)
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=40 + i, max_tokens=96, output_format=JSON_FORMAT)
              for i in range(len(prompts))]
    plain = build_engine(target, None).generate(prompts, params)
    for result in plain:
        validate(json.loads(_text(target, result.token_ids)), SCHEMA)
    for k in (2, 6):
        config = EngineConfig(spec=SpecConfig(adaptive=False, k_init=k), calibrate=False)
        assert [r.token_ids for r in build_engine(target, draft, config).generate(prompts, params)] == [
            r.token_ids for r in plain]


def test_a_draft_that_is_the_target_is_always_accepted_under_a_format(tiny_models) -> None:
    """With the target as its own draft every drafted token is accepted, but only if the drafter masks its steps as
    the verifier masks each position: a drafter without masks proposes tokens the format refuses."""
    target = tiny_models[0]
    params = SamplingParams(temperature=0.0, max_tokens=64, output_format=JSON_FORMAT)
    results = build_engine(target, target, FIXED_K).generate(_prompts(4), params)
    assert all(r.stats["drafted"] > 0 and r.stats["accepted"] == r.stats["drafted"] for r in results)
    masked = build_engine(target, target, FIXED_K)
    unmasked = SpeculativeEngine(masked.verifier, LocalDrafter(masked.drafter.runner), FIXED_K, masked.eos_token_ids,
                                 masked.decode)
    results = unmasked.generate(_prompts(4), params)
    assert sum(r.stats["accepted"] for r in results) < sum(r.stats["drafted"] for r in results)


@pytest.mark.parametrize("seeded", [False, True], ids=["min-p-over-q", "client-seeded-gumbel"])
def test_sampled_formatted_output_follows_the_target_distribution(tiny_models, seeded: bool) -> None:
    """Second-token marginal over 3000 runs against sum_t p(t) p(. | t), each the target's tempered distribution
    restricted by hand to what REGEX allows there (a, b or c first; the digits each of them takes second)."""
    target, draft, _ = tiny_models
    prompt = [72, 101, 108, 108, 111, 44, 32, 119]
    params = [SamplingParams(temperature=1.5, seed=s if seeded else None, max_tokens=2, output_format=REGEX_FORMAT)
              for s in range(3000)]
    engine = build_engine(target, draft, EngineConfig(spec=SpecConfig(adaptive=False, k_init=2), max_batch=500,
                                                      calibrate=False))
    results = engine.generate([prompt] * len(params), params)
    assert sum(r.stats["accepted"] for r in results) > 300
    seconds = {"a": "0123", "b": "4567", "c": "89"}

    def restricted(logits: torch.Tensor, allowed: str) -> torch.Tensor:
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[_ids(target, allowed)] = True
        return (logits / 1.5).masked_fill(~keep, float("-inf")).softmax(-1)

    with torch.inference_mode():
        p_first = restricted(target.model(torch.tensor([prompt])).logits[0, -1], "abc")
        support = p_first.nonzero().flatten().tolist()
        last = target.model(torch.tensor([prompt + [t] for t in support])).logits[:, -1]
        p_second = torch.stack([restricted(last[i], seconds[_text(target, [t])]) for i, t in enumerate(support)])
    assert_second_tokens_follow(results, p_first, support, p_second)


def test_a_starting_gateway_builds_the_format_tokenizer_before_any_formatted_request(tiny_models) -> None:
    """A server builds llguidance's tokenizer as it starts (core.formats.build_in_background), so its first formatted
    request does not wait for it: here, with the cached one dropped first, it is built with no request at all."""
    target, draft, _ = tiny_models
    formats._built.pop(target.tokenizer, None)  # built by earlier tests of this process
    server = ServerThread(tiny_backend(target, draft))
    try:
        eos = tuple(sorted(server.engine.eos_token_ids))
        assert server.wait_for(lambda: eos in formats._built.get(target.tokenizer, {}), timeout=30)
    finally:
        server.stop()


def test_a_failed_build_ahead_is_logged_and_left_to_the_first_request(caplog) -> None:
    build_in_background(object(), [0]).join(timeout=30)  # not a tokenizer llguidance can read
    assert "building llguidance's tokenizer ahead of requests failed" in caplog.text


def test_the_mask_budget_leaves_out_the_garbage_collectors_time() -> None:
    """A full collection among many live objects costs its thread real CPU time; the clock the mask budget reads
    leaves it out (a row it fell in was refused for it, at 452 ms, in a CI run of the distribution test)."""
    import gc
    import time

    graph = [[index] for index in range(1_500_000)]  # noqa: F841 (kept alive: the collector walks it)
    cpu, thread = format_masks._cpu(), time.thread_time()
    gc.collect()
    collected = time.thread_time() - thread
    assert collected > 0.02
    assert format_masks._cpu() - cpu < collected / 5
