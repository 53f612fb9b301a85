"""core.bf16_linear's product: within bf16's rounding of the exact product at the real pair's shapes, a row's result
the same bit for bit whatever its call's other rows, the packing undone exactly, and models loaded in bf16 running
on it (eager and compiled) with the logits oneDNN's product gives within rounding, speculative greedy decoding equal
to plain decoding; `TANDEM_CPU_LINEAR=onednn` and shapes it does not take keep oneDNN's product. Its AVX2 path gives
the AVX-512 path's bits, and a CPU that torch and oneDNN run at AVX2 (emulated here by their own settings) runs bf16
models on it, where oneDNN packs no bf16. Where the CPU has AVX512-BF16, the dot-product path holds the same
properties (its own bits), and the probe or TANDEM_CPU_LINEAR picks one path for the process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tandem.core import bf16_linear, device
from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.core.packed_linear import PackedLinear
from tandem.core.runner import ModelRunner
from tandem.engines.local import build_engine
from tandem.models.loader import load_model

pytestmark = pytest.mark.skipif(not bf16_linear.ready(), reason="no AVX2 or AVX-512 CPU without AMX, or no compiler")
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


def paths() -> list[int]:
    """The kernel's paths this CPU runs: the one in force, and on an AVX-512 CPU the others it has."""
    if not bf16_linear.ready():
        return []
    if bf16_linear.isa_bits() == 256:
        return [256]
    return [512, 256] + ([bf16_linear.DOT] if bf16_linear.runs_dot() else [])


@pytest.mark.parametrize("path", paths())
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_the_product_is_exact_within_bf16_rounding(out_features: int, in_features: int, path: int) -> None:
    generator = torch.Generator().manual_seed(out_features)
    weight = (torch.randn(out_features, in_features, generator=generator) * 0.05).bfloat16()
    bias = torch.randn(out_features, generator=generator).bfloat16()
    layer = PackedLinear(weight, bias)
    assert layer.tiled
    with bf16_linear.isa(path):
        for rows in (1, 3, 8, 13, 29):
            x = torch.randn(rows, in_features, generator=generator).bfloat16()
            within_rounding(layer(x), x, weight, bias)


@pytest.mark.parametrize("path", paths())
def test_a_rows_result_does_not_depend_on_its_call(path: int) -> None:
    """What keeps a verified token's logits those of a one-row step: every row count (the row tiles of 12 and the
    remainders) and every position in the call give a row the same bits, on each path; an odd number of inputs
    too (the dot products' last input paired with a zero)."""
    generator = torch.Generator().manual_seed(1)
    for shape in ((8960, 1536), (96, 35)):
        weight = torch.randn(shape, generator=generator).bfloat16()
        layer = PackedLinear(weight, None)
        x = torch.randn(40, shape[1], generator=generator).bfloat16()
        with bf16_linear.isa(path):
            full = layer(x)
            for first, count in ((0, 1), (7, 1), (3, 5), (11, 2), (12, 12), (5, 25), (0, 13)):
                assert torch.equal(layer(x[first : first + count]), full[first : first + count]), (first, count)
            assert torch.equal(layer(x[None, None, 7]), full[None, None, 7])  # a lone row in a 3-D batch
            assert layer(x[:0]).shape == (0, shape[0])
        within_rounding(full, x, weight, None)


@pytest.mark.skipif(bf16_linear.ready() and bf16_linear.isa_bits() == 256, reason="an AVX2 CPU runs one path only")
def test_the_avx2_path_gives_the_avx512_paths_bits() -> None:
    """Both paths sum each output over the inputs in order, one multiply-add each, and round it once: the same bits
    at every row count (the AVX2 path's row tiles of 3, the AVX-512 path's of 12), with and without a bias."""
    generator = torch.Generator().manual_seed(3)
    in_force = bf16_linear.isa_bits()
    for out_features, in_features in SHAPES[2:4]:
        weight = (torch.randn(out_features, in_features, generator=generator) * 0.05).bfloat16()
        bias = torch.randn(out_features, generator=generator).bfloat16()
        packed = bf16_linear.pack(weight)
        x = torch.randn(29, in_features, generator=generator).bfloat16()
        x[3, 5] = float("nan")
        for rows in (1, 2, 3, 4, 7, 13, 29):
            for b in (bias, None):
                with bf16_linear.isa(512):
                    wide = bf16_linear.bf16_linear(x[:rows], packed, b)
                with bf16_linear.isa(256):
                    narrow = bf16_linear.bf16_linear(x[:rows], packed, b)
                assert torch.equal(wide.isnan(), narrow.isnan()) and (rows < 4 or wide[3].isnan().all())
                assert torch.equal(wide.nan_to_num(), narrow.nan_to_num()), (out_features, rows, b is None)
    assert bf16_linear.isa_bits() == in_force  # the context restored it
    with pytest.raises(RuntimeError, match="512, 256, 16 or 0"):
        torch.ops.tandem.bf16_linear_isa(128)


@pytest.mark.skipif(not bf16_linear.ready() or not bf16_linear.runs_dot(), reason="no AVX512-BF16 here")
def test_the_probe_takes_the_dot_products_where_they_win_by_the_margin() -> None:
    """On a CPU with both AVX-512 paths, the process runs the dot products exactly where its probe timed them
    DOT_MARGIN times as fast as the multiply-adds (a NaN input stays a NaN row there too)."""
    probed = bf16_linear.probed()
    assert set(probed) == {"fma", "dot"} and all(seconds > 0 for seconds in probed.values())
    wins = probed["fma"] >= bf16_linear.DOT_MARGIN * probed["dot"]
    assert bf16_linear.isa_bits() == (bf16_linear.DOT if wins else 512)
    x = torch.randn(3, 64).bfloat16()
    x[1, 2] = float("nan")
    with bf16_linear.isa(bf16_linear.DOT):
        y = bf16_linear.bf16_linear(x, bf16_linear.pack(torch.randn(64, 64).bfloat16()), None)
    assert y[1].isnan().all() and not y[[0, 2]].isnan().any()


AVX2_CHECK = """
import torch
from tandem.core import bf16_linear, packed_linear
from tandem.core.packed_linear import PackedLinear
from tandem.models.loader import load_model
cpu = torch.device("cpu")
assert torch.backends.cpu.get_cpu_capability() == "AVX2" and not packed_linear.supported(torch.bfloat16)
assert bf16_linear.ready() and bf16_linear.isa_bits() == 256
loaded = load_model(DIR, device=cpu, dtype=torch.bfloat16, progress=False)
eager = load_model(DIR, device=cpu, dtype=torch.bfloat16, progress=False, eager=True)
packed = [m for m in loaded.model.modules() if isinstance(m, PackedLinear)]
left = [m for m in loaded.model.modules() if type(m) is torch.nn.Linear]
assert packed and all(m.tiled for m in packed), packed
assert all(m.out_features % bf16_linear.PANEL for m in left), left
ids = torch.arange(3, 40)[None]
with torch.inference_mode():
    got, expected = (m.model(ids).logits.float() for m in (loaded, eager))
assert (got - expected).abs().max() <= 0.05 * expected.abs().max(), (got - expected).abs().max()
print("ok", len(packed), len(left))
"""


def test_an_avx2_cpu_runs_bf16_models_on_the_kernel(tiny_dirs) -> None:
    """With torch's kernels and oneDNN held to AVX2 (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA), as on a CPU without
    AVX-512, oneDNN packs no bf16, and a bf16 model's layers take the kernel's AVX2 path (those it takes; the rest
    stay nn.Linear) with the eager model's logits within rounding."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    code = AVX2_CHECK.replace("DIR", repr(str(tiny_dirs.target)))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stderr[-3000:]


def test_dtype_auto_picks_bf16_where_the_kernel_runs(monkeypatch) -> None:
    """On a CPU without AVX512-BF16 or AMX (an AVX2 one), bf16 on the kernel reads half float32's bytes at the same
    rate: `--dtype auto` picks it while the kernel is on, float32 with TANDEM_CPU_LINEAR=onednn."""
    monkeypatch.setattr(device, "cpu_has_fast_bf16", lambda: False)  # what /proc/cpuinfo says on an AVX2 CPU
    assert device.select_dtype("auto", CPU) == torch.bfloat16
    with bf16_linear.enabled(False):
        assert device.select_dtype("auto", CPU) == torch.float32


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
    code = ("from tandem.core import bf16_linear; print(bf16_linear.ENABLED[0], bf16_linear.ready() and "
            "bf16_linear.isa_bits(), bool(bf16_linear.probed()))")
    fma = 256 if bf16_linear.isa_bits() == 256 else 512
    dot = bf16_linear.DOT if bf16_linear.runs_dot() else fma  # (asked of a CPU without it: the other, said in a log)
    for setting, expected in (("onednn", "False"), ("kernel", f"True {bf16_linear.isa_bits()} {dot != fma}"),
                              ("kernel-fma", f"True {fma} False"), ("kernel-dot", f"True {dot} False")):
        env = {**os.environ, "TANDEM_CPU_LINEAR": setting}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert done.stdout.strip().startswith(expected), (setting, done.stdout, done.stderr[-2000:])
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
