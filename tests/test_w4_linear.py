"""W4 draft weights (core.w4_linear): a one-row step multiplies by the layer's int4 copy, anything wider by its w8a8
layer, the loader quantizes (and fuses) only where asked or where "auto" picks it, and a compiled draft runs the same
one-row product as an eager one. That a w4 draft leaves the engine's output exactly plain decoding's, greedy and
seeded, is tested with the int8 ones in tests/test_int8_linear.py."""

from __future__ import annotations

import pytest
import torch

from tandem.core.fused_linear import FusedPart
from tandem.core.packed_linear import weight_bytes
from tandem.core.runner import ModelRunner
from tandem.core.w4_linear import LEVELS, W4Linear, int4_group, quantize_w4, supported
from tandem.core.w8a8_linear import W8A8Linear
from tandem.engines.options import ClusterOptions, LocalOptions
from tandem.models.loader import load_model

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not supported(), reason="the int4 or int8 CPU kernels do not run here")


def _expected(layer: W4Linear, x: torch.Tensor) -> torch.Tensor:
    """The one-row product the layer stands for, in float64, from the weight its int4 levels dequantize to."""
    y = x.double() @ layer.dequantized().double().t()
    return y if layer.bias is None else y + layer.bias.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_multiplies_by_the_int4_weight_and_wider_steps_by_the_w8a8_one(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 96, bias=True).to(dtype)
    layer = W4Linear.from_linear(linear)
    assert layer.group == int4_group(128, 96) == 128
    # Each weight within half a step of its group's range of the w8a8 weight it was quantized from (plus the
    # rounding of the scales, held in the activations' dtype).
    source = layer.wide.dequantized().reshape(96, -1, layer.group)
    step = (source.amax(-1, keepdim=True) - source.amin(-1, keepdim=True)) / LEVELS
    error = (layer.dequantized().reshape(96, -1, layer.group) - source).abs()
    slack = 1e-5 if dtype == torch.float32 else 2e-2
    assert (error <= step * (0.5 + slack) + slack * source.abs()).all()
    with torch.no_grad():
        for shape in ((1, 128), (1, 1, 128)):
            x = torch.randn(shape, dtype=dtype)
            y = layer(x)
            assert y.dtype == dtype and y.shape == (*shape[:-1], 96)
            tolerance = 1e-4 if dtype == torch.float32 else 3e-2
            assert torch.allclose(y.double(), _expected(layer, x), atol=tolerance, rtol=tolerance)
            # A coarser draft, not another one: close to the unquantized layer, further than the w8a8 product.
            exact = linear(x).float()
            assert (y.float() - exact).norm() < 0.15 * exact.norm()
            assert not torch.equal(y, layer.wide(x))
        for shape in ((2, 128), (3, 1, 128), (2, 7, 128)):
            x = torch.randn(shape, dtype=dtype)
            assert torch.equal(layer(x), layer.wide(x))
        head = layer.first_rows(32)
        x = torch.randn(1, 128, dtype=dtype)
        assert torch.equal(head(x), layer(x)[..., :32])
        assert torch.equal(head(x.expand(4, -1)), layer(x.expand(4, -1))[..., :32])
        assert head.weight_bytes < layer.weight_bytes


def test_a_layer_the_int4_packing_cannot_take_stays_w8a8() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 100), torch.nn.Linear(100, 64), torch.nn.Linear(64, 64))
    assert quantize_w4(model) == 3
    assert [type(layer) for layer in model] == [W8A8Linear, W8A8Linear, W4Linear]
    with pytest.raises(ValueError, match="multiples of 16"):
        W4Linear(torch.randn(100, 64), None)


def test_loader_quantizes_and_fuses_only_when_asked(tiny_dirs) -> None:
    plain = load_model(str(tiny_dirs.draft), device=CPU, dtype=torch.bfloat16, progress=False)
    w4 = load_model(str(tiny_dirs.draft), device=CPU, dtype=torch.bfloat16, progress=False, quantization="w4")
    assert w4.quantization == "w4"
    assert not any(type(m) is torch.nn.Linear for m in w4.model.modules())
    parts = [m for m in w4.model.modules() if isinstance(m, FusedPart)]
    assert parts and all(isinstance(p.fused.linear, W4Linear) for p in parts)
    assert isinstance(w4.model.get_output_embeddings(), W4Linear)
    # What a one-row step reads: int4 levels and a scale and zero point per group, about a quarter of bf16.
    assert 0.2 < weight_bytes(w4.model) / weight_bytes(plain.model) < 0.35
    for options in (LocalOptions, ClusterOptions):
        assert options(draft_quantization="w4").draft_quantization == "w4"


def test_auto_holds_a_bf16_draft_on_an_avx512_cpu_as_w4_and_none_elsewhere(tiny_dirs, monkeypatch, caplog) -> None:
    """Drafts' default: w4 where it was measured to pay (a bf16 draft on an AVX-512 CPU), their weights as loaded
    elsewhere; every entry point defaults to it, and the loaded model and the log say what was picked."""
    import logging

    from tandem.cli.main import build_parser
    from tandem.core.model_options import resolve_quantization
    from tandem.errors import InvalidArgument

    avx512 = torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX512_BF16", "AMX")
    caplog.set_level(logging.INFO, logger="tandem.models.loader")
    auto = load_model(str(tiny_dirs.draft), device=CPU, dtype=torch.bfloat16, progress=False, quantization="auto")
    assert auto.quantization == ("w4" if avx512 else "none")
    assert auto.weights == ("w4" if avx512 else "bfloat16")  # what workers' info and `tandem pools status` show
    assert f"weights held as {auto.quantization} (quantization auto, on cpu in bfloat16)" in caplog.text
    assert any(isinstance(m, W4Linear) for m in auto.model.modules()) == avx512
    for device, dtype, eager in ((CPU, torch.float32, False), (CPU, torch.bfloat16, True),
                                 (torch.device("cuda"), torch.bfloat16, False)):
        assert resolve_quantization("auto", device, dtype, eager) == "none"
    assert resolve_quantization("w8a8", CPU, torch.float32, True) == "w8a8"  # asked for, it is what it says
    with pytest.raises(InvalidArgument, match="quantization"):
        resolve_quantization("fp8", CPU, torch.bfloat16, False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")  # not measured there
    assert resolve_quantization("auto", CPU, torch.bfloat16, False) == "none"
    assert LocalOptions().draft_quantization == ClusterOptions().draft_quantization == "auto"
    for command in (["generate", "hello"], ["serve"], ["bench"], ["pools", "start", "--name", "p"]):
        assert build_parser().parse_known_args(command)[0].draft_quantization == "auto"


def test_quantize_refuses_a_device_without_the_kernels() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64)).to("meta")
    with pytest.raises(ValueError, match="do not run on meta"):
        quantize_w4(model)


@pytest.mark.slow
def test_a_compiled_w4_draft_runs_the_int4_product_for_one_row(tiny_dirs) -> None:
    """The compiled one-row forward (its own shape class) takes the int4 product, as the eager one does; a forward
    of two tokens takes the w8a8 one in both."""
    draft = load_model(str(tiny_dirs.draft), device=CPU, dtype=torch.float32, progress=False, quantization="w4")
    runners = [ModelRunner(draft.model, kv_tokens=512, compile=compile) for compile in (True, False)]
    assert runners[0].warm_up() > 0 and runners[0].graphs.compile_error is None
    logits = {}
    for runner in runners:
        state = runner.state("s")
        state.sync(0, list(range(3, 40)))
        runner.prefill(state, 36)
        one = runner.forward([state], [1])[0]
        state.sync(37, [41, 42])
        two = runner.forward([state], [2])[0]
        logits[runner.graphs is not None] = (one, two)
    for eager, compiled in zip(logits[False], logits[True], strict=True):
        assert torch.allclose(eager, compiled, atol=1e-4)
    assert runners[0].graphs.replays > 0
    # The int4 product is another one than the w8a8 layer's: a compiled one-row step that ran the w8a8 product
    # would match the forward whose every product is w8a8.
    assert not torch.allclose(logits[True][0], _w8a8_logits(draft.model, list(range(3, 40))), atol=1e-4)


def _w8a8_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """The last token's logits with every W4Linear running its w8a8 product (the whole sequence in one forward)."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1:].float()


def test_a_layer_quantized_a_few_rows_at_a_time_packs_as_it_would_whole(monkeypatch) -> None:
    """quantize_int4 quantizes and packs PACK_ROWS-aligned chunks of rows apart (no copy of the whole layer): 208
    rows asked in chunks of 16 run in chunks of 64 (the last 16) and give the packed levels and scales that one chunk
    gives. (Planted: chunks of 16 rows pack otherwise.)"""
    from tandem.core import w4_linear

    torch.manual_seed(0)
    weight, bias = torch.randn(208, 256, dtype=torch.bfloat16), torch.randn(208, dtype=torch.bfloat16)
    whole = W4Linear(weight, bias)
    monkeypatch.setattr(w4_linear, "CHUNK_ELEMENTS", 16 * 256)
    chunked = W4Linear(weight, bias)
    assert torch.equal(chunked.packed, whole.packed)
    assert torch.equal(chunked.scales_and_zeros, whole.scales_and_zeros)
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    assert torch.equal(chunked(x), whole(x))
