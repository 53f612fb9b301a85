"""W8A8 draft weights (core.w8a8_linear): the layer is int8 x int8 with per-row scales, a row's product ignores its
batch mates, and the loader quantizes (and fuses) only where asked. That a w8a8 draft leaves the engine's output
exactly plain decoding's, greedy and seeded, is tested with the int8 one in tests/test_int8_linear.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tandem.core.fused_linear import FusedPart
from tandem.core.packed_linear import weight_bytes
from tandem.core.w8a8_linear import NARROW, W8A8Linear, quantize_w8a8, supported
from tandem.engines.options import ClusterOptions, LocalOptions
from tandem.models.loader import load_model
from tandem.workers.worker_base import WorkerConfig, load_runner

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not supported(), reason="oneDNN's int8 GEMM does not run here")


def _expected(layer: W8A8Linear, x: torch.Tensor) -> torch.Tensor:
    """The product the layer stands for, computed in float64: each row quantized to the levels -top..top of its own
    scale (top 127, or 63 where the CPU's kernel would saturate: activation_levels)."""
    rows = x.reshape(-1, x.shape[-1]).double()
    row_scale = rows.abs().amax(dim=-1, keepdim=True) / layer.top
    levels = torch.round(rows / row_scale)
    y = (levels * row_scale) @ layer.dequantized().double().t()
    if layer.bias is not None:
        y = y + layer.bias.double()
    return y.reshape(*x.shape[:-1], layer.out_features)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features", [96, NARROW + 32])
def test_w8a8_linear_is_the_int8_product_with_per_row_scales(dtype: torch.dtype, out_features: int) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, out_features, bias=True).to(dtype)
    layer = W8A8Linear.from_linear(linear)
    # Each weight within half a step of the original, one step per output row.
    step = layer.scale[:, None]
    assert ((layer.dequantized() - linear.weight.float()).abs() <= step * 0.5 * (1 + 1e-5)).all()
    with torch.no_grad():
        for shape in ((1, 64), (3, 1, 64), (2, 7, 64)):
            x = torch.randn(shape, dtype=dtype)
            y = layer(x)
            assert y.dtype == dtype and y.shape == (*shape[:-1], out_features)
            tolerance = 1e-4 if dtype == torch.float32 else 2e-2
            assert torch.allclose(y.double(), _expected(layer, x), atol=tolerance, rtol=tolerance)
            # Close to the unquantized layer too: a coarser draft, not another one.
            exact = linear(x).float()
            assert (y.float() - exact).norm() < 0.03 * exact.norm()
        # A row's product does not depend on the rows beside it (the int32 products are exact).
        x = torch.randn(5, 64, dtype=dtype)
        x[2] *= 100  # an outlier row coarsens only itself
        assert torch.equal(torch.cat([layer(row[None]) for row in x]), layer(x))
        head = layer.first_rows(30)
        assert torch.equal(head(x), layer(x)[..., :30])
        assert head.weight_bytes < layer.weight_bytes


def test_the_largest_levels_multiply_exactly_on_this_cpu() -> None:
    """Every activation and weight at its largest level, with the signs matched so that no product cancels another:
    the sums a kernel that adds pairs of products in saturating int16 clips (AVX2 without VNNI, where the sums came
    out 4e4 short). The levels the layer quantizes its activations to must be ones this CPU's kernel sums exactly."""
    signs = torch.where(torch.arange(64) % 3 == 0, -1.0, 1.0)
    layer = W8A8Linear(signs.expand(96, -1) * 0.5, None)
    x = (signs * 3.0).expand(4, -1)
    with torch.no_grad():
        assert torch.allclose(layer(x), torch.full((4, 96), 64 * 1.5), rtol=1e-6, atol=0)
        assert torch.allclose(layer(x[:1]), torch.full((1, 96), 64 * 1.5), rtol=1e-6, atol=0)


def test_the_product_runs_on_a_onednn_jit_kernel_not_its_reference_one() -> None:
    """oneDNN falls back to a scalar reference kernel for int8 products it has no fast kernel for (int8 activations
    on a CPU with VNNI but no AMX: 600x slower): its verbose log names the implementation each product ran on."""
    script = ("import torch; from tandem.core.w8a8_linear import W8A8Linear; "
              "W8A8Linear(torch.randn(1152, 896), None)(torch.randn(8, 896, dtype=torch.bfloat16))")
    run = subprocess.run([sys.executable, "-c", script], env=os.environ | {"ONEDNN_VERBOSE": "1"},
                         capture_output=True, text=True, timeout=120, check=True)
    products = [line for line in run.stdout.splitlines() if ",exec,cpu,matmul," in line]
    assert products, run.stdout[-2000:]
    assert not any(",ref" in line for line in products), products


def test_loader_quantizes_and_fuses_only_when_asked(tiny_dirs) -> None:
    plain = load_model(str(tiny_dirs.draft), device=CPU, dtype=torch.bfloat16, progress=False)
    w8a8 = load_model(str(tiny_dirs.draft), device=CPU, dtype=torch.bfloat16, progress=False, quantization="w8a8")
    assert w8a8.quantization == "w8a8"
    assert not any(type(m) is torch.nn.Linear for m in w8a8.model.modules())
    assert not any(isinstance(m, W8A8Linear) for m in plain.model.modules())
    # q/k/v and gate/up are each one int8 product, as the bf16 siblings are one packed product.
    parts = [m for m in w8a8.model.modules() if isinstance(m, FusedPart)]
    assert parts and all(isinstance(p.fused.linear, W8A8Linear) for p in parts)
    assert 0.45 < weight_bytes(w8a8.model) / weight_bytes(plain.model) < 0.6
    assert isinstance(w8a8.model.get_output_embeddings(), W8A8Linear)
    assert w8a8.model.get_input_embeddings().weight.dtype == torch.bfloat16
    for options in (LocalOptions, ClusterOptions):
        assert options(draft_quantization="w8a8").draft_quantization == "w8a8"


def test_quantize_refuses_a_device_without_the_kernel() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4)).to("meta")
    with pytest.raises(ValueError, match="int8 GEMM does not run on meta"):
        quantize_w8a8(model)


def test_a_draft_worker_loads_w8a8_weights_when_configured(tiny_dirs) -> None:
    runner = load_runner(WorkerConfig(model=str(tiny_dirs.draft), dtype="float32", quantization="w8a8")).runner
    assert any(isinstance(m, W8A8Linear) for m in runner.model.modules())


def test_forward_benchmark_compares_the_w8a8_draft_with_the_draft_as_loaded(tiny_dirs, tmp_path) -> None:
    import json

    from tandem.bench import forward_ab

    out = tmp_path / "ab.json"
    assert forward_ab.main(["--compare", "w8a8", "--target", str(tiny_dirs.target), "--draft", str(tiny_dirs.draft),
                            "--dtype", "float32", "--widths", "1", "3", "--steps", "2", "--context", "20",
                            "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert "target" not in report  # a target is never quantized
    for width in ("1", "3"):
        row = report["draft"][width]
        assert row["w8a8_s"] > 0 and row["as_loaded_s"] > 0 and row["speedup"] > 0
        assert 0 < row["max_logit_diff"] < 1.0  # a coarser draft, not another one


@pytest.mark.slow
def test_draft_weights_benchmark_runs_every_draft_and_keeps_the_output(tiny_dirs, tmp_path) -> None:
    import json

    from tandem.bench import draft_weights

    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "dw.json"
    prompts.write_text('{"prompt": "def add(a, b):"}\n{"prompt": "hello"}\n')
    assert draft_weights.main(["--target", str(tiny_dirs.target), "--draft", str(tiny_dirs.draft), "--dtype",
                               "float32", "--prompts", str(prompts), "--max-tokens", "8", "--threads", "1",
                               "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["linear_ms"]["w8a8_onednn"]["1"] > 0
    for method in draft_weights.METHODS:
        assert report[method]["tok_s"] > 0 and report[method]["same_as_plain"] == 2, method
    assert report["config"]["weight_bytes"]["auto_w8a8"] < 0.6 * report["config"]["weight_bytes"]["auto"]
