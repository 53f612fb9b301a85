"""core.flex_decode: attention over each row's live key blocks gives sdpa's result, uncompiled and compiled with
dynamic shapes, and the runner's attention turns to it only where core.attention.FLEX says. The compiled decoder
attending with it runs on a GPU only (tests/test_cuda_graphs.py): inductor's CPU template fails inside one."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.exc import InductorError
from torch.fx.experimental import _config as fx_config

from tandem.core import attention
from tandem.core.flex_decode import BLOCK, flex_decode, live_block_mask


def _inputs(rows: int, width: int, length: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(rows, 6, width, 16, generator=generator)
    key, value = (torch.randn(rows, 2, length, 16, generator=generator) for _ in range(2))
    # Row r has cached starts[r] keys; its query j sees keys up to starts[r] + j, as kv_cache.Step.mask builds.
    starts = torch.tensor([length - width, length // 3, 0][:rows])
    mask = torch.arange(length) <= (starts[:, None] + torch.arange(width))[:, None, :, None]
    return query, key, value, mask


def _sdpa(query, key, value, mask, scale=None):
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                                            enable_gqa=True)


@pytest.mark.parametrize(("width", "length"), [(1, 11), (3, 11), (1, 300), (4, 300), (2, 2 * BLOCK)])
def test_flex_decode_equals_sdpa_over_the_same_mask(width: int, length: int) -> None:
    query, key, value, mask = _inputs(3, width, length)
    torch.testing.assert_close(flex_decode(query, key, value, mask, 0.3), _sdpa(query, key, value, mask, 0.3),
                               rtol=1e-5, atol=1e-5)
    maskless = flex_decode(query[:, :, :1], key, value, None)  # one query per row, every key seen
    torch.testing.assert_close(maskless, _sdpa(query[:, :, :1], key, value, None), rtol=1e-5, atol=1e-5)


def test_a_rows_blocks_end_at_the_last_key_it_sees() -> None:
    _, _, _, mask = _inputs(3, 2, 3 * BLOCK + 5)
    counts = live_block_mask(mask, 3, 2, 3 * BLOCK + 5, torch.device("cpu")).kv_num_blocks.flatten().tolist()
    # Row 0 sees keys up to 3 * BLOCK + 4, row 1 up to (3 * BLOCK + 5) // 3 + 1 = 130, row 2 keys 0 and 1.
    assert counts == [4, 2, 1]


@pytest.mark.parametrize("duck", [
    True,
    pytest.param(False, marks=pytest.mark.xfail(
        strict=True, raises=InductorError,
        reason="inductor's CPU flex template (torch 2.13) renames its split-size symbol ks3 by text, inside ks31 too, "
               "and the C++ it writes does not compile"))])
def test_compiled_flex_decode_takes_every_length_and_width_with_one_graph(duck: bool, monkeypatch) -> None:
    """Compiled by inductor on the CPU with dynamic shapes, flex_decode gives sdpa's result for three widths and
    lengths from one graph. `duck` False is how the runner's forwards trace (core.cuda_graphs.with_trace_settings:
    equal sizes keep symbols of their own), which the CPU template cannot compile: one reason FLEX_DEVICES is the GPU
    alone."""
    monkeypatch.setattr(fx_config, "use_duck_shape", duck)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(flex_decode, dynamic=True)
    # The first call's sizes are all distinct (3 rows, width 4, 2 key heads, 6 heads, head size 16): duck shapes would
    # give equal sizes one symbol and recompile once they part.
    for width, length in ((4, 140), (3, 300), (5, 700)):
        query, key, value, mask = _inputs(3, width, length, seed=width)
        torch.testing.assert_close(compiled(query, key, value, mask), _sdpa(query, key, value, mask),
                                   rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize(("flex", "devices", "compiled", "used"), [
    (False, ("cpu",), True, False), (True, ("cuda",), True, False), (True, ("cpu",), False, False),
    (True, ("cpu",), True, True)])
def test_attention_turns_to_flex_only_when_set_compiled_and_on_its_devices(flex, devices, compiled, used,
                                                                           monkeypatch) -> None:
    """The runner's attention (core.attention) takes flex_decode only with FLEX set, inside a compiled forward, on
    FLEX_DEVICES (a CPU here: dynamo traces it and runs the traced graph without inductor), and gives sdpa's result
    either way."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class Attention(torch.nn.Module):
        num_key_value_groups = 3
        is_causal = True

    called: list[bool] = []
    real = attention.flex_decode
    monkeypatch.setattr(attention, "FLEX", [flex])
    monkeypatch.setattr(attention, "FLEX_DEVICES", devices)
    monkeypatch.setattr(attention, "flex_decode", lambda *args: called.append(True) or real(*args))
    torch._dynamo.reset()
    forward = attention.packed_sdpa_forward
    if compiled:
        forward = torch.compile(forward, backend="eager", fullgraph=True)
    query, key, value, mask = _inputs(3, 2, 40)
    got, _ = forward(Attention().eval(), query, key, value, mask, scaling=0.3)
    expected, _ = sdpa_attention_forward(Attention(), query, key, value, mask, scaling=0.3)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert bool(called) == used


# Each TANDEM_GPU_ATTENTION value against the cells it sets (None: unset), or "error".
GPU_ATTENTION_CHOICES = {None: "False False", "sdpa": "False False", "flex": "True False", "triton": "False True",
                         "flash": "error"}


def test_the_environment_picks_the_gpu_attention() -> None:
    """TANDEM_GPU_ATTENTION=flex sets core.attention.FLEX, =triton TRITON, when tandem is imported (the cells are read
    once: one fresh interpreter reloads the module under each value); sdpa, or nothing, leaves sdpa; anything else
    stops with the choices."""
    code = """
import importlib, json, os, sys
os.environ.pop("TANDEM_GPU_ATTENTION", None)
from tandem.core import attention
seen = {}
for env in json.loads(sys.argv[1]):
    os.environ.pop("TANDEM_GPU_ATTENTION", None)
    if env is not None:
        os.environ["TANDEM_GPU_ATTENTION"] = env
    try:
        importlib.reload(attention)
        seen[str(env)] = f"{attention.FLEX[0]} {attention.TRITON[0]}"
    except ValueError as exc:
        seen[str(env)] = f"error: {exc}"
print(json.dumps(seen))
"""
    done = subprocess.run([sys.executable, "-c", code, json.dumps(list(GPU_ATTENTION_CHOICES))], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen.pop("flash") == "error: TANDEM_GPU_ATTENTION: one of sdpa, flex, triton, got 'flash'"
    assert seen == {str(env): cells for env, cells in GPU_ATTENTION_CHOICES.items() if cells != "error"}
