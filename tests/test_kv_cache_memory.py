"""The runner's KV cache in memory: steady decoding writes in place and allocates nothing that grows with the
context, verifying several tokens a row does not repeat the key-value heads, and a capacity a long sequence left
shrinks once it has gone."""

from __future__ import annotations

import pytest
import torch

from kv_cache_harness import TIGHT, _recomputed, _tokens
from tandem.bench.allocations import AllocationMeter
from tandem.core.runner import ModelRunner


def _decode(runner: ModelRunner, states, steps: int) -> list[int]:
    pointers = []
    for _ in range(steps):
        logits = runner.forward(states, [1] * len(states))
        for state, row in zip(states, logits, strict=True):
            state.tokens.append(int(row[-1].argmax()))
        pointers.append([t.data_ptr() for layer in runner.cache.layers for t in (layer.keys, layer.values)])
    return pointers


def test_a_capacity_left_by_a_long_sequence_shrinks_once_it_is_gone(tiny_models) -> None:
    """A GPU's graphs read every position of the buffers, so a capacity a finished long sequence left would cost
    every later step: the first forward after it has gone shrinks the cache, and what the others hold is kept. A
    retained session's sequence, or a new long prompt, is held, so nothing shrinks under it."""
    model = tiny_models[0].model
    runner = ModelRunner(model, kv_tokens=65536)
    kept = runner.state("kept", session="chat")
    kept.sync(0, _tokens(0, 1200))
    runner.prefill(kept, 1200)
    runner.release("kept", retain=True)
    short = runner.state("short")
    short.sync(0, _tokens(1, 40))
    runner.prefill(short, 39)
    logits = runner.forward([short], [1])[0]
    assert runner.cache.capacity >= 1200  # the retained session still holds its 1200 tokens
    assert runner.state("back", session="chat").cached == 1200  # the session returns to its cache ...
    runner.release("back")  # ... and ends without keeping it
    short.sync(len(short.tokens), [int(logits[-1].argmax())])
    again = runner.forward([short], [1])[0]
    assert runner.cache.capacity == 256 and runner.kv_tokens_reserved == runner.cache.slots * 256
    torch.testing.assert_close(again, _recomputed(model, short.tokens, 1), **TIGHT)
    long = runner.state("long")
    long.sync(0, _tokens(2, 1100))
    runner.prefill(long, 1100)  # grows straight to what the prompt needs, with nothing shrunk first
    assert runner.cache.capacity >= 1100


@pytest.mark.parametrize("batch", [1, 4])
def test_steady_decoding_writes_in_place_and_allocates_nothing_that_grows_with_context(tiny_models,
                                                                                       batch: int) -> None:
    model = tiny_models[0].model
    per_step, live = {}, {}
    for context in (40, 400):
        runner = ModelRunner(model, kv_tokens=8192)
        states = []
        for i in range(batch):
            state = runner.state(f"s{i}")
            state.sync(0, _tokens(i, context + 3 * i))  # rows of different lengths
            states.append(state)
        _decode(runner, states, 2)  # prefill, and the capacity the decode needs
        shape = (runner.cache.slots, runner.cache.capacity)
        pointers = _decode(runner, states, 4)
        assert all(p == pointers[0] for p in pointers) and (runner.cache.slots, runner.cache.capacity) == shape
        meter = AllocationMeter()
        with meter:
            _decode(runner, states, 4)
        # Attention's own workspace (scores over the context) is not a copy of the cache.
        per_step[context] = (meter.allocated - meter.by_op["aten::scaled_dot_product_attention"]) / 4
        live[context] = runner.kv_tokens_used * runner.cache.reserved_bytes / runner.kv_tokens_reserved
    copies = (per_step[400] - per_step[40]) / (live[400] - live[40])
    assert copies < 0.02, f"{copies:.3f} copies of the KV cache per step"


def test_verifying_several_tokens_per_row_does_not_repeat_the_key_value_heads(tiny_models) -> None:
    model = tiny_models[0].model
    assert model.config.num_attention_heads > model.config.num_key_value_heads  # grouped-query attention
    per_step, live = {}, {}
    for context in (40, 400):
        runner = ModelRunner(model, kv_tokens=8192)
        states = []
        for i in range(3):
            state = runner.state(f"s{i}")
            state.sync(0, _tokens(i, context + 5 * i))
            runner.prefill(state, len(state.tokens) - 1)
            state.tokens.extend([5, 6, 7, 8])
            states.append(state)
        meter = AllocationMeter()
        with meter:
            logits = runner.forward(states, [5, 5, 5])
        for state, row in zip(states, logits, strict=True):
            torch.testing.assert_close(row, _recomputed(model, state.tokens, 5), **TIGHT)
        per_step[context] = meter.allocated - meter.by_op["aten::scaled_dot_product_attention"]
        live[context] = runner.kv_tokens_used  # no retained sessions: the rows' own tokens
    kv_token_bytes = runner.cache.reserved_bytes / runner.kv_tokens_reserved
    copies = (per_step[400] - per_step[40]) / ((live[400] - live[40]) * kv_token_bytes)
    assert copies < 0.05, f"{copies:.3f} copies of the KV cache per step"
