"""core.bf16_linear's product: within bf16's rounding of the exact product at the real pair's shapes, a row's result
the same bit for bit whatever its call's other rows, the packing undone exactly, and models loaded in bf16 running
on it (eager and compiled) with the logits oneDNN's product gives within rounding, speculative greedy decoding equal
to plain decoding; `TANDEM_CPU_LINEAR=onednn` and shapes it does not take keep oneDNN's product."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tandem.core import bf16_linear
from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.core.packed_linear import PackedLinear
from tandem.core.runner import ModelRunner
from tandem.engines.local import build_engine
from tandem.models.loader import load_model

pytestmark = pytest.mark.skipif(not bf16_linear.ready(), reason="no AVX-512 CPU without AMX, or no C++ compiler")
CPU = torch.device("cpu")
# The real pair's products (out, in): MLP gate/up fused and down, q/k/v fused, the draft's MLP, a head's part.
SHAPES = ((17920, 1536), (1536, 8960), (2048, 1536), (9728, 896), (896, 4864), (4096, 896))


@pytest.fixture
def onednn():
    """Layers built while this is active take oneDNN's product, as with TANDEM_CPU_LINEAR=onednn."""
    with bf16_linear.enabled(False):
        yield


def within_rounding(result: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Each output is a float32 sum rounded once to bf16: off the exact value by half a bf16 step of it, plus the
    float32 sum's own error (relative 2^-24 per input, against the sum of the products' magnitudes)."""
    exact = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
    magnitude = x.double().abs() @ weight.double().abs().t() + (0 if bias is None else bias.double().abs())
    allowed = exact.abs() * 2.0**-8 + magnitude * x.shape[-1] * 2.0**-24 + 1e-30
    assert ((result.double() - exact).abs() <= allowed).all()


@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_the_product_is_exact_within_bf16_rounding(out_features: int, in_features: int) -> None:
    generator = torch.Generator().manual_seed(out_features)
    weight = (torch.randn(out_features, in_features, generator=generator) * 0.05).bfloat16()
    bias = torch.randn(out_features, generator=generator).bfloat16()
    layer = PackedLinear(weight, bias)
    assert layer.tiled
    for rows in (1, 3, 8, 13, 29):
        x = torch.randn(rows, in_features, generator=generator).bfloat16()
        within_rounding(layer(x), x, weight, bias)


def test_a_rows_result_does_not_depend_on_its_call() -> None:
    """What keeps a verified token's logits those of a one-row step: every row count (the row tiles of 12 and the
    remainders) and every position in the call give a row the same bits."""
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(8960, 1536, generator=generator).bfloat16()
    layer = PackedLinear(weight, None)
    x = torch.randn(40, 1536, generator=generator).bfloat16()
    full = layer(x)
    for first, count in ((0, 1), (7, 1), (3, 5), (11, 2), (12, 12), (5, 25), (0, 13)):
        assert torch.equal(layer(x[first : first + count]), full[first : first + count]), (first, count)
    assert torch.equal(layer(x[None, None, 7]), full[None, None, 7])  # a lone row in a 3-D batch
    assert layer(x[:0]).shape == (0, 8960)


def test_packing_is_undone_exactly_and_a_heads_part_is_its_rows() -> None:
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(4096, 896, generator=generator).bfloat16()
    layer = PackedLinear(weight, None)
    assert layer.packed.shape == (4096 // bf16_linear.PANEL, 896, bf16_linear.PANEL)
    assert torch.equal(layer.dense_weight(), weight)
    head = layer.first_rows(1024)
    x = torch.randn(3, 896, generator=generator).bfloat16()
    assert head.tiled and torch.equal(head(x), layer(x)[:, :1024])


def test_shapes_and_settings_it_does_not_take_keep_onednn(onednn) -> None:
    weight = torch.randn(64, 48).bfloat16()
    assert not PackedLinear(weight, None).tiled  # built with the kernel off
    bf16_linear.ENABLED[0] = True
    assert PackedLinear(weight, None).tiled
    assert not PackedLinear(torch.randn(80, 48).bfloat16(), None).tiled  # outputs not a multiple of 32
    assert not PackedLinear(torch.randn(64, 48), None).tiled  # float32


def test_the_setting_is_read_from_the_environment() -> None:
    code = "from tandem.core import bf16_linear; print(bf16_linear.ENABLED[0])"
    for setting, expected in (("onednn", "False"), ("kernel", "True")):
        env = {**os.environ, "TANDEM_CPU_LINEAR": setting}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert done.stdout.strip() == expected, done.stderr[-2000:]
    env = {**os.environ, "TANDEM_CPU_LINEAR": "mkl"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode != 0 and "TANDEM_CPU_LINEAR" in done.stderr


def runner_logits(model: torch.nn.Module, compile: bool = False) -> torch.Tensor:
    runner = ModelRunner(model, kv_tokens=512, compile=compile)
    state = runner.state("a")
    state.sync(0, list(range(3, 40)))
    runner.prefill(state, 32)
    logits = runner.forward([state], [5])[0].float()  # a verification's shape: 5 tokens on a cached prompt
    if compile:  # it ran as a compiled static forward
        assert runner.graphs.compiled and runner.graphs.replays >= 1 and runner.graphs.compile_error is None
    return logits


def test_a_bf16_model_runs_on_it_with_onednns_logits_within_rounding(tiny_dirs, onednn) -> None:
    reference = load_model(str(tiny_dirs.target), device=CPU, dtype=torch.bfloat16, progress=False)
    bf16_linear.ENABLED[0] = True
    loaded = load_model(str(tiny_dirs.target), device=CPU, dtype=torch.bfloat16, progress=False)
    layers = [m for m in loaded.model.modules() if isinstance(m, PackedLinear)]
    assert layers and all(layer.tiled for layer in layers)
    assert not any(m.tiled for m in reference.model.modules() if isinstance(m, PackedLinear))
    expected = runner_logits(reference.model)
    scale = expected.abs().max()
    for compile in (False, True):  # the compiled forward calls the op as it was traced
        assert (runner_logits(loaded.model, compile) - expected).abs().max() <= 0.05 * scale, compile


def test_speculative_greedy_on_it_equals_plain_greedy_in_bf16(tiny_dirs) -> None:
    """Each row's products do not depend on the step's width, nor does the decode-attention kernel's: in bf16 a
    verification gives each drafted position the logits a one-token step gives it, so speculative greedy decoding
    gives plain decoding's tokens, not only up to near-ties."""
    target = load_model(str(tiny_dirs.target), device=CPU, dtype=torch.bfloat16, progress=False)
    draft = load_model(str(tiny_dirs.draft), device=CPU, dtype=torch.bfloat16, progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 30)]
    outputs = {}
    for name, spec in (("plain", SpecConfig(enabled=False)), ("spec", SpecConfig(k_max=4, k_init=4, adaptive=False))):
        engine = build_engine(target, draft if spec.enabled else None, EngineConfig(spec=spec, calibrate=False))
        outputs[name] = [result.token_ids for result in engine.generate(prompts, params)]
    assert outputs["spec"] == outputs["plain"]
