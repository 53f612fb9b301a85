"""Prepacked oneDNN linears (core.packed_linear): the same numbers as nn.Linear in bf16, rows independent of their
step's other rows in every packed dtype (what keeps verification exact), and only where they apply. bf16 layers run
oneDNN's product here; tandem's own (core.bf16_linear) has tests/test_bf16_linear.py."""

from __future__ import annotations

import pytest
import torch

from tandem.core import bf16_linear
from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.core.packed_linear import (
    MIN_PACKED_WEIGHTS,
    PackedLinear,
    packable,
    prepack,
    supported,
    weight_bytes,
)
from tandem.core.runner import ModelRunner
from tandem.engines.local import build_engine
from tandem.models.loader import load_model

CPU = torch.device("cpu")
PACKED = [pytest.param(dtype, marks=pytest.mark.skipif(not supported(dtype), reason=f"oneDNN cannot pack {dtype} here"))
          for dtype in (torch.bfloat16, torch.float32)]


@pytest.fixture(autouse=True)
def pack_small_layers(monkeypatch):
    """The tiny models' layers are all below the float32 size limit: pack them anyway, to test the packed path."""
    monkeypatch.setitem(MIN_PACKED_WEIGHTS, torch.float32, 0)


@pytest.fixture(autouse=True)
def onednn_bf16():
    """oneDNN's products in bf16 too, where tandem's own kernel would take them (tests/test_bf16_linear.py)."""
    with bf16_linear.enabled(False):
        yield


def load(path, dtype: torch.dtype = torch.bfloat16, eager: bool = False):
    return load_model(str(path), device=CPU, dtype=dtype, progress=False, eager=eager)


def linears(model: torch.nn.Module, kind: type) -> int:
    return sum(type(module) is kind for module in model.modules())


def runner_logits(model: torch.nn.Module, prompt: tuple[int, ...] = tuple(range(3, 40)), want: int = 5) -> torch.Tensor:
    """The logits of a prompt's last `want` tokens, through a fresh ModelRunner."""
    runner = ModelRunner(model, kv_tokens=512)
    state = runner.state("a")
    state.sync(0, list(prompt))
    return runner.forward([state], [want])[0]


def same(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    """bf16 packing runs nn.Linear's own oneDNN kernel (bit-identical); float32 replaces PyTorch's BLAS, whose
    rounding differs slightly."""
    return torch.equal(a, b) if dtype == torch.bfloat16 else torch.allclose(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", PACKED)
def test_packed_linear_matches_nn_linear(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 80, bias=True).to(dtype)
    packed = PackedLinear.from_linear(linear)
    with torch.no_grad():
        for shape in ((1, 48), (3, 1, 48), (2, 7, 48)):
            x = torch.randn(shape, dtype=dtype)
            assert same(packed(x), linear(x), dtype)
        head = packed.first_rows(30)
        x = torch.randn(2, 3, 48, dtype=dtype)
        assert torch.equal(head(x), packed(x)[..., :30])


@pytest.mark.skipif(not supported(torch.float32), reason="oneDNN cannot pack float32 here")
def test_a_packed_rows_result_does_not_depend_on_its_step_mates() -> None:
    """In float32, the dtype exactness is held to, a verify forward of k + 1 rows must give each row what a one-row
    decode step gives it (the real pair's MLP, attention and head shapes, where BLAS libraries switch kernels with
    the row count; a lone row and a row in a 3-D batch included)."""
    torch.manual_seed(0)
    for out_features, in_features in ((8960, 1536), (1536, 8960), (1536, 1536), (4096, 896)):
        packed = PackedLinear(torch.randn(out_features, in_features), None)
        x = torch.randn(40, in_features)
        with torch.no_grad():
            full = packed(x)
            assert all(torch.equal(packed(x[i : i + 1]), full[i : i + 1]) for i in range(0, 40, 3))
            assert all(torch.equal(packed(x[i : i + 5]), full[i : i + 5]) for i in range(0, 40, 5))
            assert torch.equal(packed(x[None, None, 7]), full[None, None, 7])


@pytest.mark.skipif(not supported(torch.bfloat16), reason="oneDNN cannot pack bf16 here")
def test_packed_bf16_gives_nn_linears_result_at_every_row_count() -> None:
    """bf16 is not held to row independence (on an AMX CPU nn.Linear's own result depends on the row count); packing
    must change nothing: the same values as nn.Linear for every count of rows."""
    torch.manual_seed(0)
    for out_features, in_features in ((8960, 1536), (4096, 896)):
        weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
        packed = PackedLinear(weight, None)
        x = torch.randn(40, in_features, dtype=torch.bfloat16)
        with torch.no_grad():
            assert all(torch.equal(packed(x[:n]), torch.nn.functional.linear(x[:n], weight)) for n in (1, 2, 5, 16, 40))


@pytest.mark.parametrize("dtype", PACKED)
def test_loader_packs_on_cpu_in_packable_dtypes_only(tiny_dirs, dtype: torch.dtype) -> None:
    fast, eager = load(tiny_dirs.target, dtype), load(tiny_dirs.target, dtype, eager=True)
    half = load(tiny_dirs.target, torch.float16)
    assert linears(fast.model, torch.nn.Linear) == 0 and linears(fast.model, PackedLinear) > 0
    assert linears(eager.model, PackedLinear) == 0 and linears(half.model, PackedLinear) == 0
    assert not packable(half.model)
    assert weight_bytes(fast.model) == weight_bytes(eager.model) > 0
    assert prepack(fast.model) == 0  # already packed: a second call changes nothing
    # The tied embedding keeps its plain weight for lookups; the head is a packed copy of it.
    assert isinstance(fast.model.get_output_embeddings(), PackedLinear)
    assert fast.model.get_input_embeddings().weight.dtype == dtype


@pytest.mark.parametrize("dtype", PACKED)
def test_packed_model_logits_equal_eager_in_runner_and_generate(tiny_dirs, dtype: torch.dtype) -> None:
    fast, eager = load(tiny_dirs.target, dtype), load(tiny_dirs.target, dtype, eager=True)
    prompt = tuple(range(3, 40))
    logits = [runner_logits(loaded.model, prompt) for loaded in (fast, eager)]
    assert same(logits[0], logits[1], dtype)
    ids = torch.tensor([prompt])
    outs = [loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                  pad_token_id=0) for loaded in (fast, eager)]
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", PACKED)
def test_packed_draft_head_scores_part_of_the_vocabulary(tiny_dirs, dtype: torch.dtype) -> None:
    fast, eager = load(tiny_dirs.draft, dtype), load(tiny_dirs.draft, dtype, eager=True)
    results = []
    for loaded in (fast, eager):
        runner = ModelRunner(loaded.model, kv_tokens=512, vocab_limit=50)
        state = runner.state("a")
        state.sync(0, list(range(3, 20)))
        results.append(runner.forward([state], [2])[0])
    assert results[0].shape[-1] == 50 and same(results[0], results[1], dtype)


@pytest.mark.parametrize("dtype", PACKED)
def test_speculative_engine_on_packed_models_equals_plain_greedy(tiny_dirs, dtype: torch.dtype) -> None:
    target, draft = load(tiny_dirs.target, dtype), load(tiny_dirs.draft, dtype)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 30)]
    outputs = {}
    for name, spec in (("plain", SpecConfig(enabled=False)), ("spec", SpecConfig(k_max=4, k_init=4, adaptive=False))):
        engine = build_engine(target, draft if spec.enabled else None, EngineConfig(spec=spec, calibrate=False))
        outputs[name] = [result.token_ids for result in engine.generate(prompts, params)]  # one batch
    if dtype == torch.float32:  # the dtype exactness is held to
        assert outputs["spec"] == outputs["plain"]
        return
    # In bf16 a (k + 1)-token verify forward and a 1-token forward round differently (on an AMX CPU nn.Linear's own
    # result depends on the row count), so greedy outputs may part, but only where the target's two best logits
    # are within bf16's rounding of each other: anywhere else a difference is a bug.
    for prompt, plain, spec in zip(prompts, outputs["plain"], outputs["spec"], strict=True):
        if plain != spec:
            at = next(i for i, (a, b) in enumerate(zip(plain, spec, strict=True)) if a != b)
            with torch.no_grad():
                logits = target.model(torch.tensor([prompt + plain[:at]])).logits[0, -1].float()
            gap = (logits[plain[at]] - logits[spec[at]]).abs()
            assert gap <= 2 * torch.finfo(torch.bfloat16).eps * logits.abs().max(), (prompt, at, gap)


def test_models_stay_eager_where_the_cpu_cannot_pack() -> None:
    """Not skipped with the rest: a layer in a dtype oneDNN cannot pack here, and that tandem's bf16 kernel does not
    take (16 outputs; on an AVX2 CPU it takes bf16 layers of multiples of 32), is left alone."""
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        model = torch.nn.Sequential(torch.nn.Linear(16, 16)).to(dtype)
        assert packable(model) == (supported(dtype) or bf16_linear.fits_layer(32, dtype, torch.device("cpu")))
        assert prepack(model) == (1 if supported(dtype) else 0)
    assert not supported(torch.float16)


@pytest.mark.skipif(not supported(torch.float32), reason="oneDNN cannot pack float32 here")
def test_small_float32_layers_stay_on_pytorchs_blas(monkeypatch) -> None:
    monkeypatch.setitem(MIN_PACKED_WEIGHTS, torch.float32, 1 << 20)
    model = torch.nn.Sequential(torch.nn.Linear(1536, 256), torch.nn.Linear(1024, 1024))
    assert prepack(model) == 1
    assert type(model[0]) is torch.nn.Linear and isinstance(model[1], PackedLinear)
