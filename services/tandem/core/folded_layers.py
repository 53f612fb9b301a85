"""Decoder layers folded into their products, for batch-1 steps on a GPU: each layer's two RMSNorms, its activation
and its two residual adds run inside its four products (core.fused_linear.StackedLinear).

Why: on an H200 a batch-1 step of the 1.5B target launched about 14 kernels a layer, each a few microseconds, so
the gaps and fixed costs between them were as much of the step as the bytes read (docs/performance.md, "On a GPU").
A pre-norm layer (Qwen2, Llama, Mistral) computes

    h = x + o(attention(qkv(norm_1(x))));    out = h + down(silu(gate(norm_2(h))) * up(norm_2(h)))

and each norm's output feeds only the product after it, the activation only down, each residual add only the
product's output. So the folded layer hands each of them to a product: q/k/v normalise their input, gate/up too, o
adds the layer's input (left in its residual cell, since Hugging Face's attention calls o with its input alone),
down takes gate/up's output whole, applies the activation, and adds its own input's residual. With
core.fused_linear.ROW_PRODUCTS on, a one-row product does all of that in core.triton_gemv's kernel: four products a
layer and no kernel between them beyond the attention's. Off, the products run the same ops in torch around cuBLAS,
which is what the layer ran, so a folded model computes what the model did (tests/test_triton_gemv.py).

Folded only where the layer, its norms and its MLP are the known classes, whose forwards are the formula above.
"""

from __future__ import annotations

import torch

from tandem.core.fused_linear import FusedPart, StackedLinear

# Layers whose forward is the pre-norm formula above, norms computing weight * (x / rms(x)).to(x.dtype) with
# `variance_epsilon`, and MLPs computing down(act(gate(x)) * up(x)) with act silu.
LAYERS = ("Qwen2DecoderLayer", "Qwen3DecoderLayer", "LlamaDecoderLayer", "MistralDecoderLayer")
RMS_NORMS = ("Qwen2RMSNorm", "Qwen3RMSNorm", "LlamaRMSNorm", "MistralRMSNorm")
MLPS = ("Qwen2MLP", "Qwen3MLP", "LlamaMLP", "MistralMLP")
SILU = ("SiLUActivation", "SiLU")


class FoldedMLP(torch.nn.Module):
    """gate/up's stacked product (the norm in front of it folded in), then down over its whole output: the
    activation and, where the layer passes one, the residual add run in down."""

    def __init__(self, gate_up: StackedLinear, down: StackedLinear) -> None:
        super().__init__()
        self.gate_up, self.down = gate_up, down

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.down(self.gate_up(x), residual=residual, gated=True)


def folded_forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
    """A folded layer's forward, taking what the model passes a decoder layer (everything past the hidden states by
    keyword, under the names the layer's own attention takes, whichever transformers version named them)."""
    self.self_attn.o_proj.residual_cell[0] = hidden_states  # o adds the layer's input to its product
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
    return self.mlp(hidden_states, residual=hidden_states)


_FOLDED_CLASSES: dict[type, type] = {}


def _folded_class(cls: type) -> type:
    """`cls` with folded_forward: the layer keeps its type for isinstance and its attributes as they are."""
    if cls not in _FOLDED_CLASSES:
        _FOLDED_CLASSES[cls] = type(f"Folded{cls.__name__}", (cls,), {"forward": folded_forward})
    return _FOLDED_CLASSES[cls]


def _stacked(linear: StackedLinear | torch.nn.Linear) -> StackedLinear:
    if type(linear) is StackedLinear:
        return linear
    return StackedLinear(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())


def _foldable(layer: torch.nn.Module) -> bool:
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    parts = getattr(attention, "q_proj", None), getattr(mlp, "gate_proj", None)
    return (type(layer).__name__ in LAYERS and type(mlp).__name__ in MLPS
            and type(getattr(mlp, "act_fn", None)).__name__ in SILU
            and all(type(getattr(layer, name, None)).__name__ in RMS_NORMS
                    for name in ("input_layernorm", "post_attention_layernorm"))
            and all(isinstance(part, FusedPart) and type(part.fused.linear) is StackedLinear for part in parts)
            and all(type(linear) in (StackedLinear, torch.nn.Linear) for linear in (attention.o_proj, mlp.down_proj)))


def fold_layers(model: torch.nn.Module) -> int:
    """Fold every decoder layer of `model` whose q/k/v and gate/up are already StackedLinear parts (core.fused_linear
    fuse) and whose classes are the known ones, in place; the number of layers folded."""
    folded = 0
    for layer in list(model.modules()):
        if not _foldable(layer):
            continue
        attention, mlp = layer.self_attn, layer.mlp
        for part, norm in ((attention.q_proj, layer.input_layernorm), (mlp.gate_proj, layer.post_attention_layernorm)):
            product = part.fused.linear
            product.norm = torch.nn.Parameter(norm.weight.detach(), requires_grad=False)
            product.eps = float(norm.variance_epsilon)
        attention.o_proj = _stacked(attention.o_proj)
        layer.mlp = FoldedMLP(mlp.gate_proj.fused.linear, _stacked(mlp.down_proj))
        layer.input_layernorm = torch.nn.Identity()
        layer.post_attention_layernorm = torch.nn.Identity()
        layer.__class__ = _folded_class(type(layer))
        folded += 1
    return folded
