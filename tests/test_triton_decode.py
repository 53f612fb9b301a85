"""core.triton_decode: the split-key decode attention gives sdpa's result over the runner's prefix masks, in float32,
for one and several queries per row, GQA groups of 6 and 7, keys over many splits or few, and the runner's attention
turns to it only where core.attention.TRITON says. Needs Triton (a GPU machine has it; the dev extra installs it,
so CI runs these); without a GPU the kernel runs under Triton's interpreter. The compiled decoder attending with it
runs in tests/test_cuda_graphs.py, on a GPU."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":  # conftest sets it
    pytest.skip("without a GPU these need Triton's interpreter, chosen before Triton is imported",
                allow_module_level=True)
pytest.importorskip("triton")

from tandem.core import attention
from tandem.core.triton_decode import SPLIT, split_decode

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _inputs(rows: int, heads: int, kv_heads: int, width: int, length: int, dim: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(rows, heads, width, dim, generator=generator)
    key, value = (torch.randn(rows, kv_heads, length, dim, generator=generator) for _ in range(2))
    # Row r has cached starts[r] keys; its query j sees keys up to starts[r] + j, as core.cuda_graphs builds them.
    starts = torch.randint(0, length - width + 1, (rows,), generator=generator)
    starts[0] = length - width  # one row reaching the last key
    mask = torch.arange(length) <= (starts[:, None] + torch.arange(width))[:, None, :, None]
    return [t.to(DEVICE) for t in (query, key, value, mask)]


def _sdpa(query, key, value, mask, scale=None):
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                                            enable_gqa=True)


@pytest.mark.parametrize(("rows", "heads", "kv_heads", "width", "length", "dim"), [
    (1, 12, 2, 1, 3 * SPLIT + 17, 128),  # the target's heads, one query, four splits
    (3, 14, 2, 5, 200, 64),  # the draft's heads, verification width, rows reaching different splits
    (2, 4, 4, 1, 40, 32),  # no grouping, fewer keys than a tile
    (2, 12, 2, 16, SPLIT, 128),  # the widest static forward, exactly one split
])
def test_split_decode_equals_sdpa_over_prefix_masks(rows, heads, kv_heads, width, length, dim) -> None:
    query, key, value, mask = _inputs(rows, heads, kv_heads, width, length, dim)
    torch.testing.assert_close(split_decode(query, key, value, mask, 0.1), _sdpa(query, key, value, mask, 0.1),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split", [0, 64, 256, 1024])
def test_other_splits_of_the_keys_give_the_same_result(split: int) -> None:
    """Keys per thread block other than SPLIT (the sizes the GPU probe times beside it): rows reaching different
    splits, a verify width; at 1024 one split holds every key; at 0 one block walks every key, nothing merged."""
    query, key, value, mask = _inputs(3, 12, 2, 5, 3 * SPLIT + 17, 64)
    torch.testing.assert_close(split_decode(query, key, value, mask, 0.1, split=split),
                               _sdpa(query, key, value, mask, 0.1), rtol=1e-5, atol=1e-5)


def test_the_probe_times_each_split_against_pytorchs_pick() -> None:
    """tandem.bench.gpu_measures.attention_costs names the kernel at SPLIT and at TRITON_SPLITS, each checked
    against sdpa before it is timed (a mismatch is recorded as an error, not a time)."""
    from tandem.bench import gpu_measures

    costs = gpu_measures.attention_costs(DEVICE, {"default": None, "triton": gpu_measures.TRITON}, caps=(200,),
                                         rows=(1,), widths=(3,), reps=10)
    names = ["default", "triton"] + [f"triton_split{split}" for split in gpu_measures.TRITON_SPLITS]
    assert list(costs) == names
    assert all(isinstance(seconds, float) and seconds > 0
               for by_shape in costs.values() for seconds in by_shape.values())


def test_without_a_mask_every_key_is_seen_and_the_scale_defaults_to_sdpas() -> None:
    query, key, value, _ = _inputs(2, 12, 2, 1, 2 * SPLIT + 5, 64)
    torch.testing.assert_close(split_decode(query, key, value, None), _sdpa(query, key, value, None),
                               rtol=1e-5, atol=1e-5)


def test_keys_past_a_rows_reach_are_never_read() -> None:
    """A row's keys past its last allowed one may hold anything (the buffer's unused positions): NaN there changes
    nothing, in splits the row reaches and in splits past it."""
    query, key, value, mask = _inputs(2, 12, 2, 3, 4 * SPLIT, 64)
    mask[:, :, :, SPLIT + 10:] = False
    expected = split_decode(query, key, value, mask)
    key[:, :, SPLIT + 10:], value[:, :, SPLIT + 10:] = float("nan"), float("nan")
    got = split_decode(query, key, value, mask)
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("triton", [False, True])
def test_attention_turns_to_the_triton_kernel_only_when_set(triton: bool, monkeypatch) -> None:
    """Inside a compiled forward (dynamo traces it, with dynamic shapes, and runs the graph without inductor) on
    FLEX_DEVICES, core.attention takes split_decode with TRITON set, and gives sdpa's result either way. Without a
    GPU the kernel stands in as sdpa here: dynamo's fake tensors cannot pass through Triton's interpreter (the
    kernel's own results are the tests above)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class Attention(torch.nn.Module):
        num_key_value_groups = 6
        is_causal = True

    called: list[bool] = []
    import tandem.core.triton_decode as triton_decode

    real = triton_decode.split_decode if DEVICE.type == "cuda" else _sdpa
    monkeypatch.setattr(attention, "TRITON", [triton])
    monkeypatch.setattr(attention, "FLEX", [False])
    monkeypatch.setattr(attention, "FLEX_DEVICES", (DEVICE.type,))
    monkeypatch.setattr(triton_decode, "split_decode", lambda *args: called.append(True) or real(*args))
    torch._dynamo.reset()
    forward = torch.compile(attention.packed_sdpa_forward, backend="eager", fullgraph=True, dynamic=True)
    query, key, value, mask = _inputs(2, 12, 2, 1, 150, 64)
    got, _ = forward(Attention().eval(), query, key, value, mask, scaling=0.3)
    expected, _ = sdpa_attention_forward(Attention(), query, key, value, mask, scaling=0.3)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert bool(called) == triton


def test_a_split_of_0_attends_each_row_in_one_kernel(monkeypatch) -> None:
    """split 0: split_decode launches whole_attention alone, at any length (the choice is the caller's, never the
    buffer's length, which compiled forwards hold symbolic and guard-free): the output normalised in the caller's
    layout, no partial results and no merge; at a split of 64 the same inputs go through both."""
    from tandem.core import triton_decode

    called = []
    for name in ("split_attention", "merge_splits", "whole_attention"):
        real = getattr(triton_decode, name)
        monkeypatch.setattr(triton_decode, name, lambda *a, _real=real, _name=name: called.append(_name) or _real(*a))
    query, key, value, mask = _inputs(2, 12, 2, 1, 3 * SPLIT + 17, 64)
    expected = _sdpa(query, key, value, mask, 0.1)
    torch.testing.assert_close(split_decode(query, key, value, mask, 0.1, split=0), expected, rtol=1e-5, atol=1e-5)
    assert called == ["whole_attention"]
    called.clear()
    torch.testing.assert_close(split_decode(query, key, value, mask, 0.1, split=64), expected, rtol=1e-5, atol=1e-5)
    assert called == ["split_attention", "merge_splits"]
