"""The runner's preallocated KV cache gives the logits a full recomputation gives: rows of different lengths and
widths, a rollback then re-extension, sequences released and retained while slots move, the cache passed by the name
the installed transformers takes, and packed rows (one attention call a row, over repeated key-value heads or not)
where padding them would cost more."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from torch.nn.attention import SDPBackend

from kv_cache_harness import TIGHT, _recomputed, _tokens
from tandem.core.kv_cache import cache_keyword
from tandem.core.runner import ModelRunner


def _alone(model, tokens: list[int], cached: int, want: int) -> torch.Tensor:
    runner = ModelRunner(model, kv_tokens=4096)
    state = runner.state("alone")
    state.sync(0, tokens)
    runner.prefill(state, cached)
    return runner.forward([state], [want])[0]


def test_rows_of_different_lengths_and_widths_match_each_row_alone_and_a_full_recomputation(tiny_models) -> None:
    model = tiny_models[0].model
    runner = ModelRunner(model, kv_tokens=4096)
    # (cached, new) per row; row 2 starts uncached, row 3 is between the others but sits this forward out.
    shapes = [(3, 1), (17, 4), (0, 6), (11, 2), (9, 3)]
    sequences = [_tokens(i, cached + new) for i, (cached, new) in enumerate(shapes)]
    states = []
    for i, ((cached, _), tokens) in enumerate(zip(shapes, sequences, strict=True)):
        state = runner.state(f"s{i}")
        state.sync(0, tokens)
        runner.prefill(state, cached)
        states.append(state)
    taking_part = [0, 4, 2, 1]  # not in slot order
    wants = [1, 3, 6, 2]
    batched = runner.forward([states[i] for i in taking_part], wants)
    for i, want, logits in zip(taking_part, wants, batched, strict=True):
        cached, new = shapes[i]
        assert logits.shape == (want, runner.vocab_size) and states[i].cached == cached + new
        torch.testing.assert_close(logits, _alone(model, sequences[i], cached, want), **TIGHT)
        torch.testing.assert_close(logits, _recomputed(model, sequences[i], want), **TIGHT)
    assert states[3].cached == shapes[3][0]  # the row that sat out wrote nothing
    torch.testing.assert_close(runner.forward([states[3]], [2])[0], _recomputed(model, sequences[3], 2), **TIGHT)


def test_the_runner_passes_its_cache_by_the_name_the_installed_transformers_takes(tiny_models) -> None:
    """transformers 5.24 renamed the forward's `past_key_values` to `cache` and drops the old name in 5.40: a
    runner's forwards name the cache as the installed release declares it, and raise no deprecation warning."""
    model = tiny_models[0].model
    keyword = cache_keyword(model.base_model)
    assert keyword in {"cache", "past_key_values"} & set(inspect.signature(model.base_model.forward).parameters)
    runner = ModelRunner(model, kv_tokens=1024)
    state = runner.state("named")
    state.sync(0, _tokens(5, 12))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner.prefill(state, 11)
        logits = runner.forward([state], [1])[0]
    assert not [w for w in caught if "past_key_values" in str(w.message)]
    torch.testing.assert_close(logits, _recomputed(model, state.tokens, 1), **TIGHT)


def test_rollback_then_reextend_equals_a_fresh_run(tiny_models) -> None:
    model = tiny_models[0].model
    runner = ModelRunner(model, kv_tokens=4096)
    prompt, rejected, accepted = _tokens(1, 20), _tokens(2, 5), _tokens(3, 3)
    other = runner.state("other")
    other.sync(0, _tokens(4, 30))
    state = runner.state("a")
    state.sync(0, prompt + rejected)
    runner.forward([other, state], [1, 5])
    state.sync(len(prompt) + 1, accepted)  # keeps the first drafted token, rolls back four
    assert state.cached == len(prompt) + 1
    other.tokens.append(7)
    rolled = runner.forward([state, other], [3, 1])
    expected = prompt + rejected[:1] + accepted
    torch.testing.assert_close(rolled[0], _recomputed(model, expected, 3), **TIGHT)
    torch.testing.assert_close(rolled[1], _recomputed(model, other.tokens, 1), **TIGHT)


def test_released_and_retained_sequences_keep_their_keys_when_slots_move(tiny_models) -> None:
    model = tiny_models[0].model
    runner = ModelRunner(model, kv_tokens=4096)
    sequences = {name: _tokens(i, 12 + i) for i, name in enumerate("abcd")}
    for name, tokens in sequences.items():
        state = runner.state(name, session=f"chat-{name}")
        state.sync(0, tokens)
        runner.prefill(state, len(tokens) - 1)
    runner.release("a", retain=True)  # d moves into a's slot, a is kept above the active ones
    runner.release("b")
    assert sorted(s.slot for s in runner.states.values()) == [0, 1]
    resumed = runner.state("a2", session="chat-a")
    assert resumed.cached == len(sequences["a"]) - 1 and resumed.slot == 2
    states = [runner.states[name] for name in ("c", "d", "a2")]
    logits = runner.forward(states, [1, 1, 1])
    for name, row in zip("cda", logits, strict=True):
        torch.testing.assert_close(row, _recomputed(model, sequences[name], 1), **TIGHT)


@pytest.mark.parametrize("backends", [None, (SDPBackend.MATH,)], ids=["any-kernel", "math-kernel"])
@pytest.mark.parametrize("width", [1, 3])
def test_packed_attention_equals_repeated_key_value_heads(width: int, backends, monkeypatch) -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from tandem.core import attention
    from tandem.core.attention import packed_sdpa_forward

    monkeypatch.setattr(attention, "BACKENDS", [backends])  # the kernels the packed call may use

    class Attention(torch.nn.Module):
        num_key_value_groups = 3
        is_causal = True

    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 6, width, 8, generator=generator)
    key, value = (torch.randn(2, 2, 11, 8, generator=generator) for _ in range(2))
    mask = torch.rand(2, 1, width, 11, generator=generator) < 0.7
    mask[..., 0] = True
    expected, _ = sdpa_attention_forward(Attention(), query, key, value, mask, scaling=0.3)
    packed, _ = packed_sdpa_forward(Attention().eval(), query, key, value, mask, scaling=0.3)
    torch.testing.assert_close(packed, expected, rtol=1e-6, atol=1e-6)


def test_packed_rows_give_what_padded_rows_and_a_full_recomputation_give(tiny_models, monkeypatch) -> None:
    """Rows of different widths fed packed into one row (no padding; attention per row over its own cached keys)
    give each row's logits as padding them does, and write the same keys: later forwards agree too."""
    from tandem.core.row_layout import RowLayout

    model = tiny_models[0].model
    # (cached, new) per row: uncached rows, a cached prefix, a one-token row, and a row between them sitting out.
    shapes = [(0, 9), (5, 3), (0, 1), (12, 6), (7, 0), (3, 11)]
    sequences = [_tokens(10 + i, cached + new + 2) for i, (cached, new) in enumerate(shapes)]
    taking_part = [5, 0, 3, 1, 2]
    wants = [11, 2, 1, 3, 1]
    calls = []
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        _counting(torch.nn.functional.scaled_dot_product_attention, calls))
    results = {}
    for pack in (False, True):
        runner = ModelRunner(model, kv_tokens=4096)
        states = []
        for i, ((cached, new), tokens) in enumerate(zip(shapes, sequences, strict=True)):
            state = runner.state(f"s{i}")
            state.sync(0, tokens[: cached + new])
            runner.prefill(state, cached)
            states.append(state)
        calls.clear()
        monkeypatch.setattr(RowLayout, "packs", lambda self, *shape, pack=pack: pack)
        first = runner.forward([states[i] for i in taking_part], wants)
        fed = len(calls)
        monkeypatch.setattr(RowLayout, "packs", lambda self, *shape, pack=pack: not pack)
        for i in taking_part:  # two more tokens each, through the cache the first forward wrote, the other way
            states[i].sync(states[i].cached, sequences[i][states[i].cached :])
        later = runner.forward([states[i] for i in taking_part], [2] * len(taking_part))
        results[pack] = (first, later, fed)
    (padded, padded_later, padded_calls), (packed, packed_later, packed_calls) = results[False], results[True]
    layers = model.config.num_hidden_layers
    assert padded_calls == layers and packed_calls == len(taking_part) * layers  # one attention call per row
    for i, want, a, b in zip(taking_part, wants, padded, packed, strict=True):
        cached, new = shapes[i]
        torch.testing.assert_close(b, a, **TIGHT)
        torch.testing.assert_close(b, _recomputed(model, sequences[i][: cached + new], want), **TIGHT)
    for i, a, b in zip(taking_part, padded_later, packed_later, strict=True):
        torch.testing.assert_close(b, a, **TIGHT)
        torch.testing.assert_close(b, _recomputed(model, sequences[i], 2), **TIGHT)


def _counting(function, calls: list):
    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return function(*args, **kwargs)
    return counted


def test_rows_are_packed_where_their_padding_would_cost_more_than_an_attention_call_per_row() -> None:
    from tandem.core.row_layout import PACK_AREA, packing_pays

    assert packing_pays("cpu", 8, 48, 27) and packing_pays("cpu", 8, 16, 9)  # verification of uneven drafts
    assert packing_pays("cpu", 8, 480, 413)  # prompts arriving together
    assert not packing_pays("cpu", 8, 40, 39) and not packing_pays("cpu", 8, 8, 8)  # little or no padding
    assert not packing_pays("cpu", 1, 5, 3)  # one row: nothing to pack
    assert not packing_pays("cuda", 8, 48, 27) and packing_pays("cuda", 8, PACK_AREA, 200)  # there, wide ones only
