"""Int8 draft weights (core.int8_linear): the layer computes with its dequantized weight, the loader quantizes only
where asked, and a quantized draft (int8 weight-only, w8a8: core.w8a8_linear, or w4: core.w4_linear) leaves the
engine's output exactly plain decoding's, greedy and seeded."""

from __future__ import annotations

import pytest
import torch

from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.core.int8_linear import Int8Linear, quantize_int8, supported
from tandem.core.packed_linear import weight_bytes
from tandem.core.runner import ModelRunner
from tandem.core.w4_linear import supported as w4_supported
from tandem.core.w8a8_linear import supported as w8a8_supported
from tandem.engines.local import build_engine
from tandem.engines.options import ClusterOptions, LocalOptions
from tandem.errors import InvalidArgument
from tandem.models.loader import load_model
from tandem.workers.worker_base import WorkerConfig, load_runner

CPU = torch.device("cpu")
PROMPTS = [[72, 101, 108, 108, 111, 44, 32, 119], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [97, 98, 99]]
pytestmark = pytest.mark.skipif(not supported(CPU), reason="this torch build has no int8 weight-only CPU kernel")


def _fixed(k: int) -> EngineConfig:
    return EngineConfig(spec=SpecConfig(adaptive=False, k_max=k, k_init=k), calibrate=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_multiplies_by_its_dequantized_weight(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96, bias=True).to(dtype)
    quantized = Int8Linear.from_linear(linear)
    assert quantized.qweight.dtype == torch.int8 and quantized.scale.dtype == dtype
    # Rounding to the nearest of 255 levels per row: each weight within half a step of the original (a row's
    # largest weight may sit up to a quarter step further out, where a scale rounded down to bf16 clamps it).
    step = quantized.scale.float()[:, None]
    error = (quantized.qweight.float() * step - linear.weight.float()).abs()
    assert (error <= step * 0.5 * (1 + 1e-5)).float().mean() > 0.99 and (error <= step * 0.75).all()
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    with torch.no_grad():
        for shape in ((1, 64), (3, 1, 64), (2, 7, 64)):
            x = torch.randn(shape, dtype=dtype)
            expected = torch.nn.functional.linear(x.float(), quantized.dequantized().float(), linear.bias.float())
            assert torch.allclose(quantized(x).float(), expected, atol=tolerance, rtol=tolerance)
        head = quantized.first_rows(30)
        x = torch.randn(2, 3, 64, dtype=dtype)
        assert torch.equal(head(x), quantized(x)[..., :30])
        assert head.weight_bytes < quantized.weight_bytes


def test_loader_quantizes_only_when_asked(tiny_dirs) -> None:
    plain = load_model(str(tiny_dirs.draft), device=CPU, dtype=torch.bfloat16, progress=False)
    int8 = load_model(str(tiny_dirs.draft), device=CPU, dtype=torch.bfloat16, progress=False, quantization="int8")
    assert int8.quantization == "int8" and plain.quantization == "none"
    assert not any(type(m) is torch.nn.Linear for m in int8.model.modules())
    assert not any(isinstance(m, Int8Linear) for m in plain.model.modules())
    # A draft step reads about half the bytes: int8 weights plus one bf16 scale per output row.
    assert 0.45 < weight_bytes(int8.model) / weight_bytes(plain.model) < 0.6
    # The tied embedding keeps its weight for lookups; the head is an int8 copy of it.
    assert isinstance(int8.model.get_output_embeddings(), Int8Linear)
    assert int8.model.get_input_embeddings().weight.dtype == torch.bfloat16
    with pytest.raises(InvalidArgument, match="quantization"):
        load_model(str(tiny_dirs.draft), device=CPU, dtype=torch.float32, progress=False, quantization="int4")
    for options in (LocalOptions, ClusterOptions):
        with pytest.raises(InvalidArgument, match="draft_quantization"):
            options(draft_quantization="fp8")


def test_a_draft_runner_scores_a_limited_vocabulary_with_int8_weights(int8_draft) -> None:
    full = ModelRunner(int8_draft.model, kv_tokens=256)
    limited = ModelRunner(int8_draft.model, kv_tokens=256, vocab_limit=50)
    states = [runner.state("s") for runner in (full, limited)]
    for state in states:
        state.sync(0, PROMPTS[1])
    logits = [runner.forward([state], [2])[0] for runner, state in zip((full, limited), states, strict=True)]
    assert logits[1].shape[-1] == 50
    assert torch.allclose(logits[1], logits[0][..., :50], atol=1e-5)


def test_a_draft_worker_loads_int8_weights_when_configured(tiny_dirs) -> None:
    runner = load_runner(WorkerConfig(model=str(tiny_dirs.draft), dtype="float32", quantization="int8")).runner
    assert any(isinstance(m, Int8Linear) for m in runner.model.modules())


def test_quantize_refuses_a_device_without_the_kernel() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4)).to("meta")
    with pytest.raises(ValueError, match="no aten::_weight_int8pack_mm kernel"):
        quantize_int8(model)


@pytest.fixture(scope="module", params=["int8", "w8a8", "w4"])
def int8_draft(request, tiny_dirs):
    """The draft with quantized weights, each way the loader holds them."""
    if request.param == "w8a8" and not w8a8_supported():
        pytest.skip("oneDNN's int8 GEMM does not run here")
    if request.param == "w4" and not w4_supported():
        pytest.skip("the int4 or int8 CPU kernels do not run here")
    return load_model(str(tiny_dirs.draft), device=CPU, dtype=torch.float32, progress=False,
                      quantization=request.param)


def test_an_int8_draft_keeps_greedy_output_exact(tiny_models, int8_draft) -> None:
    target = tiny_models[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = build_engine(target, None, EngineConfig(calibrate=False))
    expected = [r.token_ids for r in plain.generate(PROMPTS, greedy)]
    for config in (_fixed(1), _fixed(4), EngineConfig(calibrate=False)):
        results = build_engine(target, int8_draft, config).generate(PROMPTS, greedy)
        assert [r.token_ids for r in results] == expected
    drafted = build_engine(target, int8_draft, _fixed(4)).generate(PROMPTS, greedy)
    assert sum(r.stats["accepted"] for r in drafted) > 0.5 * sum(r.stats["drafted"] for r in drafted)


@pytest.mark.parametrize("seed", [0, 7])
def test_an_int8_draft_keeps_seeded_output_plain_decodings(tiny_models, int8_draft, seed: int) -> None:
    target, draft, _ = tiny_models
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_tokens=40, ignore_eos=True)
    plain = build_engine(target, None, EngineConfig(calibrate=False))
    expected = [r.token_ids for r in plain.generate(PROMPTS, params)]
    rates = {}
    for name, model in (("float32 draft", draft), ("int8 draft", int8_draft)):
        results = build_engine(target, model, _fixed(3)).generate(PROMPTS, params)
        assert [r.token_ids for r in results] == expected, name
        rates[name] = sum(r.stats["accepted"] for r in results) / sum(r.stats["drafted"] for r in results)
    # Quantizing the draft costs little acceptance: its choices stay the full-precision draft's almost everywhere.
    assert rates["int8 draft"] > 0.8 * rates["float32 draft"], rates
