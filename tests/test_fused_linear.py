"""Fused sibling linears (core.fused_linear): each part gives its own projection's numbers, whatever order the parts
are called in and on whatever inputs, the product is kept only until every part has read it, and prepack fuses a
model's q/k/v and gate/up without changing what it computes."""

from __future__ import annotations

import pytest
import torch

from tandem.core.folded_layers import fold_layers
from tandem.core.fused_linear import FusedLinear, FusedPart, StackedLinear, fuse, stack_on_gpu
from tandem.core.packed_linear import MIN_PACKED_WEIGHTS, PackedLinear, prepack, supported, weight_bytes
from tandem.core.runner import ModelRunner
from tandem.models.loader import load_model
from test_packed_linear import runner_logits

pytestmark = pytest.mark.skipif(not supported(torch.float32), reason="oneDNN cannot pack float32 here")
CPU = torch.device("cpu")


class Siblings(torch.nn.Module):
    """Three projections of one input, as an attention layer has them; k without a bias."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(32, 48, bias=True)
        self.k_proj = torch.nn.Linear(32, 16, bias=False)
        self.v_proj = torch.nn.Linear(32, 16, bias=True)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """oneDNN blocks a wider product's columns otherwise, so float32 sums round slightly differently."""
    return torch.allclose(a, b, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_each_part_gives_its_own_projection_in_any_call_order() -> None:
    torch.manual_seed(0)
    plain = Siblings()
    fused = Siblings()
    fused.load_state_dict(plain.state_dict())
    assert fuse(fused) == 3
    x, y = torch.randn(2, 3, 32), torch.randn(1, 32)
    names = ("q_proj", "k_proj", "v_proj")
    for order in (names, names[::-1], ("k_proj", "k_proj", "q_proj", "v_proj")):
        for name in order:
            assert close(getattr(fused, name)(x), getattr(plain, name)(x))
    # Interleaved inputs: a part called on another input computes afresh rather than reading the kept product.
    assert close(fused.q_proj(x), plain.q_proj(x))
    assert close(fused.k_proj(y), plain.k_proj(y))
    assert close(fused.v_proj(x), plain.v_proj(x))
    assert close(fused.v_proj(y), plain.v_proj(y))


@torch.no_grad()
def test_the_product_is_kept_only_until_every_part_has_read_it() -> None:
    module = Siblings()
    fuse(module)
    group = module.q_proj.fused
    x = torch.randn(4, 32)
    module.v_proj(x)
    assert group._kept[0] is not None and group._kept[0][0] is x
    module.q_proj(x)
    assert group._kept[0] is not None
    module.k_proj(x)
    assert group._kept[0] is None  # nothing of a prefill's products outlives its layer


def test_siblings_of_different_widths_or_below_the_size_limit_stay_apart() -> None:
    module = Siblings()
    module.v_proj = torch.nn.Linear(24, 16)
    assert fuse(module) == 0 and type(module.q_proj) is torch.nn.Linear
    assert fuse(Siblings(), least=10**6) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepack_fuses_attention_and_mlp_projections(tiny_dirs, monkeypatch, dtype: torch.dtype) -> None:
    if not supported(dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} here")
    monkeypatch.setitem(MIN_PACKED_WEIGHTS, torch.float32, 0)
    eager = load_model(str(tiny_dirs.target), device=CPU, dtype=dtype, progress=False, eager=True)
    fast = load_model(str(tiny_dirs.target), device=CPU, dtype=dtype, progress=False)
    layers = fast.model.config.num_hidden_layers
    groups = {id(m) for m in fast.model.modules() if isinstance(m, FusedLinear)}
    assert len(groups) == 2 * layers  # q/k/v and gate/up of every layer
    assert sum(isinstance(m, FusedPart) for m in fast.model.modules()) == 5 * layers
    assert weight_bytes(fast.model) == weight_bytes(eager.model)  # a fused weight is counted once
    assert isinstance(fast.model.get_output_embeddings(), PackedLinear)
    assert prepack(fast.model) == 0
    logits = [runner_logits(loaded.model) for loaded in (fast, eager)]
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    assert torch.allclose(logits[0], logits[1], atol=tolerance, rtol=tolerance)


def test_stacked_products_compute_what_the_siblings_did_eager_and_compiled(tiny_dirs) -> None:
    """The GPU's fusion (plain stacked linears, the layers folded into them) on a CPU: the same logits as the unfused
    model, eager and through the compiled static forward that CUDA graphs record on a GPU (dynamo traces the kept
    product whole)."""
    plain = load_model(str(tiny_dirs.target), device=CPU, dtype=torch.float32, progress=False, eager=True)
    stacked = load_model(str(tiny_dirs.target), device=CPU, dtype=torch.float32, progress=False, eager=True)
    assert stack_on_gpu(stacked.model) == 0  # a CPU model: left to prepack
    layers = stacked.model.config.num_hidden_layers
    assert fuse(stacked.model, product=StackedLinear) == 5 * layers
    assert fold_layers(stacked.model) == layers  # norms, activation and residual adds into the products
    assert sum(type(m) is StackedLinear for m in stacked.model.modules()) == 4 * layers
    assert weight_bytes(stacked.model) == weight_bytes(plain.model)
    expected = runner_logits(plain.model)
    assert torch.allclose(runner_logits(stacked.model), expected, atol=1e-5, rtol=1e-5)
    runner = ModelRunner(stacked.model, kv_tokens=512, compile=True)
    state = runner.state("a")
    state.sync(0, list(range(3, 40)))
    runner.prefill(state, 36)
    compiled = runner.forward([state], [1])[0]
    assert runner.graphs is not None and runner.graphs.compiled and runner.graphs.compile_error is None
    assert runner.graphs.replays > 0
    assert torch.allclose(compiled[-1], expected[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("compare", ["fusion", "dtype", pytest.param("compile", marks=pytest.mark.slow)])
def test_forward_benchmark_reports_both_runners_per_model_and_width(tiny_dirs, monkeypatch, tmp_path, compare) -> None:
    import json

    from tandem.bench import forward_ab

    monkeypatch.setitem(MIN_PACKED_WEIGHTS, torch.float32, 0)
    out = tmp_path / "ab.json"
    assert forward_ab.main(["--compare", compare, "--target", str(tiny_dirs.target), "--draft", str(tiny_dirs.draft),
                            "--dtype", "float32", "--widths", "1", "3", "--steps", "2", "--context", "20",
                            "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    first, second = forward_ab.VARIANTS[compare]
    for role in ("target", "draft"):
        for width in ("1", "3"):
            row = report[role][width]
            assert row[f"{first}_s"] > 0 and row[f"{second}_s"] > 0 and row["speedup"] > 0
            assert row["max_logit_diff"] < (0.5 if compare == "dtype" else 1e-3)  # dtype: bf16 against float32
        if compare == "compile":
            assert report[role]["compiled"] is True
