"""core.folded_layers: a model whose decoder layers were folded into four products each gives the unfolded model's
logits with the row-product kernel off, eager and compiled (and bit for bit in bf16 on a CPU), and Hugging Face's
greedy tokens with the kernel on through the runner, also where q/k/v's kernel writes the cache itself. The kernel's
own products: tests/test_triton_gemv.py. Needs Triton; without a GPU the kernel runs under Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":  # conftest sets it
    pytest.skip("without a GPU these need Triton's interpreter, chosen before Triton is imported",
                allow_module_level=True)
pytest.importorskip("triton")

from tandem.core import fused_linear, triton_gemv
from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.core.engine import SpeculativeEngine
from tandem.core.folded_layers import fold_layers
from tandem.core.fused_linear import StackedLinear, fuse
from tandem.core.local import LocalVerifier
from tandem.core.runner import ModelRunner
from tandem.models.loader import load_model

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _folded(path, seed: int = 0, dtype: torch.dtype = torch.float32):
    """The tiny target (float32 unless said) with random norm gains (the shipped ones are all 1: a fold that dropped
    them would pass), as loaded plainly and as a GPU would stack and fold it."""
    models = [load_model(str(path), device=DEVICE, dtype=dtype, progress=False, eager=True).model for _ in range(2)]
    generator = torch.Generator().manual_seed(seed)
    gains = {name: 1 + 0.3 * torch.randn(p.shape, generator=generator) for name, p in models[0].named_parameters()
             if "layernorm" in name}
    for model in models:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in gains:
                    p.copy_(gains[name])
    layers = models[1].config.num_hidden_layers
    assert fuse(models[1], product=StackedLinear) == 5 * layers
    assert fold_layers(models[1]) == layers and fold_layers(models[1]) == 0  # once
    assert not any("layernorm" in name for name, _ in models[1].named_parameters())
    assert all(type(layer.self_attn).__name__ == "FoldedQwen2Attention" for layer in models[1].model.layers)
    return models


def _greedy(model, prompt: list[int], tokens: int, runner: ModelRunner | None = None) -> list[int]:
    """Plain greedy decoding through the runner and engine, by default eager on either device (on a GPU the
    compiled graphs' own tests run the kernel in them; replays would not pass through the Python these tests
    count)."""
    runner = runner or ModelRunner(model, kv_tokens=256, cuda_graphs=False)
    engine = SpeculativeEngine(LocalVerifier(runner), None,
                               EngineConfig(spec=SpecConfig(enabled=False), calibrate=False, max_batch=1))
    return engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))[0].token_ids


def _hf_greedy(model, prompt: list[int], tokens: int) -> list[int]:
    """Hugging Face generate's greedy tokens after `prompt`."""
    ids = torch.tensor([prompt], device=DEVICE)
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                          do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()


def test_folded_layers_leave_the_logits_as_they_were_eager_and_compiled(tiny_dirs) -> None:
    """With the kernel off, a folded layer runs the unfolded one's ops (o adding the residual its cell holds, down
    the activation and the residual): the same logits through the model, the same tokens from Hugging Face's
    generate, and the same logits through the runner's compiled static forward (dynamo traces the residual cell's
    write and read in one graph)."""
    _same_logits_eager_and_compiled(*_folded(tiny_dirs.target))


def test_the_folded_attention_rotates_in_torch_where_the_kernel_does_not_run(tiny_dirs, monkeypatch) -> None:
    """With ROW_PRODUCTS on but nowhere for the kernel to run (ROW_DEVICES without this device), the folded
    attention takes q and k rotated from q/k/v's product in torch (StackedLinear.in_torch), every row and width:
    still the unfolded model's logits and tokens, eager and compiled."""
    monkeypatch.setattr(fused_linear, "ROW_PRODUCTS", [True])
    monkeypatch.setattr(fused_linear, "ROW_DEVICES", ())
    rotations = []
    rotate = fused_linear.rotate
    monkeypatch.setattr(fused_linear, "rotate", lambda *args: rotations.append(args[0].shape) or rotate(*args))
    plain, folded = _folded(tiny_dirs.target, seed=2)
    with torch.no_grad():
        folded(torch.tensor([[5, 6, 7]], device=DEVICE))
    assert len(rotations) == folded.config.num_hidden_layers
    _same_logits_eager_and_compiled(plain, folded)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="cuBLAS picks a kernel by shape (split-K among them), so one "
                    "stacked product need not round as the separate ones it stands for; the CPU's do, column by column")
def test_the_folded_model_in_bf16_gives_the_unfolded_logits_bit_for_bit(tiny_dirs, monkeypatch) -> None:
    """Eager bf16 with the kernel nowhere to run: each folded product runs Hugging Face's ops in their order (the
    norm, the rotation on the product's heads, the activation, the residual), so the logits are the same bits."""
    monkeypatch.setattr(fused_linear, "ROW_PRODUCTS", [True])
    monkeypatch.setattr(fused_linear, "ROW_DEVICES", ())
    plain, folded = _folded(tiny_dirs.target, seed=4, dtype=torch.bfloat16)
    ids = torch.tensor([list(range(3, 40))], device=DEVICE)
    with torch.no_grad():
        assert torch.equal(folded(ids).logits, plain(ids).logits)


def _same_logits_eager_and_compiled(plain, folded) -> None:
    ids = torch.tensor([list(range(3, 30))], device=DEVICE)
    with torch.no_grad():
        expected = plain(ids).logits
        torch.testing.assert_close(folded(ids).logits, expected, rtol=1e-5, atol=1e-5)
    # Hugging Face's generate (its own cache and keywords, as the GPU probe's peer runs) through the folded layers
    greedy = {"attention_mask": torch.ones_like(ids), "max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(folded.generate(ids, **greedy), plain.generate(ids, **greedy))
    runner = ModelRunner(folded, kv_tokens=512, compile=True)
    state = runner.state("a")
    state.sync(0, list(range(3, 30)))
    runner.prefill(state, 26)
    compiled = runner.forward([state], [1])[0]
    assert runner.graphs is not None and runner.graphs.compiled and runner.graphs.compile_error is None
    torch.testing.assert_close(compiled[-1], expected[0, -1], rtol=1e-4, atol=1e-4)
    assert all(m.residual_cell[0] is None for m in folded.modules() if isinstance(m, StackedLinear))


def test_the_kernel_in_a_folded_model_gives_hf_greedy_tokens(tiny_dirs, monkeypatch) -> None:
    """Through the runner and the engine, batch 1: every decode step's products (q/k/v with its norm and the rotary
    embedding, gate/up with its norm, o with the residual, down with the activation and the residual) run the
    kernel; the prompt's forward, of many rows, runs them in torch."""
    plain, folded = _folded(tiny_dirs.target, seed=1)
    monkeypatch.setattr(fused_linear, "ROW_PRODUCTS", [True])
    monkeypatch.setattr(fused_linear, "ROW_DEVICES", (DEVICE.type,))
    calls = []
    original = StackedLinear.forward
    monkeypatch.setattr(StackedLinear, "forward", lambda self, x, *args, **kwargs: calls.append(
        x.shape[:-1].numel()) or original(self, x, *args, **kwargs))
    prompt = list(range(5, 17))
    expected = _hf_greedy(plain, prompt, 6)
    assert _greedy(folded, prompt, 6) == expected
    assert calls.count(1) >= 4 * 5 * folded.config.num_hidden_layers  # 4 products a layer, 5 one-row steps
    # A shape left to cuBLAS (its norm then in torch) beside the kernel's: the same tokens, that shape not kernel's.
    gate_up = tuple(folded.model.layers[0].mlp.gate_up.weight.shape)
    monkeypatch.setattr(fused_linear, "CUBLAS_SHAPES", {gate_up})
    shapes, rotated = [], []
    kernel = triton_gemv.row_product
    monkeypatch.setattr(triton_gemv, "row_product", lambda x, weight, *args: shapes.append(tuple(weight.shape)) or
                        rotated.append(args[5] is not None) or kernel(x, weight, *args))
    assert _greedy(folded, prompt, 6) == expected
    assert shapes and gate_up not in shapes
    qkv = tuple(folded.model.layers[0].self_attn.q_proj.fused.linear.weight.shape)
    # q/k/v's kernel rotated q and k (the folded attention), and no other product was asked to
    assert {shape for shape, turned in zip(shapes, rotated, strict=True) if turned} == {qkv}


def test_the_folded_attention_writes_the_cache_in_its_kernel_with_hf_greedy_tokens(tiny_dirs, monkeypatch) -> None:
    """With KV_WRITES, a static one-row decode step's q/k/v kernel writes each layer's new key and value itself
    (the runner's static forwards run uncompiled here: a compiled CPU forward cannot call the interpreted kernel;
    on a GPU they are recorded and replayed): Hugging Face's greedy tokens, and every such step wrote through the
    kernel."""
    plain, folded = _folded(tiny_dirs.target, seed=3)
    monkeypatch.setattr(fused_linear, "ROW_PRODUCTS", [True])
    monkeypatch.setattr(fused_linear, "KV_WRITES", [True])
    monkeypatch.setattr(fused_linear, "ROW_DEVICES", (DEVICE.type,))
    writes = []
    kernel = triton_gemv.gemv_to_cache
    monkeypatch.setattr(triton_gemv, "gemv_to_cache", lambda *args: writes.append(1) or kernel(*args))
    prompt = list(range(7, 19))
    runner = ModelRunner(folded, kv_tokens=256, compile=True)
    runner.graphs.forward = runner.graphs.plain_forward  # static forwards, uncompiled
    assert _greedy(folded, prompt, 6, runner) == _hf_greedy(plain, prompt, 6)
    layers = folded.config.num_hidden_layers
    assert runner.graphs.replays >= 5 and writes and len(writes) % layers == 0
    if not runner.graphs.capture:  # each static step ran its Python (a GPU's replays run the recorded kernels)
        assert len(writes) == runner.graphs.replays * layers
