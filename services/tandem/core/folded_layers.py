"""Decoder layers folded into their products, for batch-1 steps on a GPU: each layer's two RMSNorms, its activation
and its two residual adds run inside its four products (core.fused_linear.StackedLinear).

Why: on an H200 a batch-1 step of the 1.5B target launched about 14 kernels a layer, each a few microseconds, so
the gaps and fixed costs between them were as much of the step as the bytes read (docs/performance.md, "On a GPU").
A pre-norm layer (Qwen2, Llama, Mistral) computes

    h = x + o(attention(qkv(norm_1(x))));    out = h + down(silu(gate(norm_2(h))) * up(norm_2(h)))

and each norm's output feeds only the product after it, the activation only down, each residual add only the
product's output. So the folded layer hands each of them to a product: q/k/v normalise their input, gate/up too, o
adds the layer's input (left in its residual cell, since Hugging Face's attention calls o with its input alone),
down takes gate/up's output whole, applies the activation, and adds its own input's residual. The attention
(Qwen2, Llama, Mistral: WINDOWS) hands its rotary embedding to q/k/v, which returns q and k rotated (and, with
core.fused_linear.KV_WRITES, writes k and v into the cache itself on a static forward's lone row). With
core.fused_linear.ROW_PRODUCTS on, a one-row product does all of that in core.triton_gemv's kernel: four products a
layer, and between them only the cache's writes and the attention. Off, the products run the same ops in torch
around cuBLAS and the attention is Hugging Face's, which is what the layer ran, so a folded model computes what the
model did (tests/test_folded_layers.py).

Folded only where the layer, its norms and its MLP are the known classes, whose forwards are the formula above; the
attention only where q, k and v are one stacked product's parts and its class is a known one.
"""

from __future__ import annotations

import sys

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from tandem.core import fused_linear
from tandem.core.fused_linear import FusedPart, StackedLinear
from tandem.core.kv_cache import SlotCache

# Layers whose forward is the pre-norm formula above, norms computing weight * (x / rms(x)).to(x.dtype) with
# `variance_epsilon`, and MLPs computing down(act(gate(x)) * up(x)) with act silu.
LAYERS = ("Qwen2DecoderLayer", "Qwen3DecoderLayer", "LlamaDecoderLayer", "MistralDecoderLayer")
RMS_NORMS = ("Qwen2RMSNorm", "Qwen3RMSNorm", "LlamaRMSNorm", "MistralRMSNorm")
MLPS = ("Qwen2MLP", "Qwen3MLP", "LlamaMLP", "MistralMLP")
SILU = ("SiLUActivation", "SiLU")
# Attentions whose forward is q/k/v, apply_rotary_pos_emb over all of each head, the cache's update, the attention
# and o, with the sliding window (or none) each passes the attention function.
WINDOWS = {"Qwen2Attention": lambda module: getattr(module, "sliding_window", None),
           "LlamaAttention": lambda module: None,
           "MistralAttention": lambda module: getattr(module.config, "sliding_window", None)}


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


def folded_attention_forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                             **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Hugging Face's attention forward with the rotary embedding inside the q/k/v product (its rope_columns): on
    one row core.triton_gemv's kernel rotates q and k as it writes them, so no kernel of its own does; elsewhere the
    product rotates them in torch, Hugging Face's ops. The cache comes by either name transformers has given it.
    With ROW_PRODUCTS off, Hugging Face's own forward runs, as measured on a GPU (inductor fuses its rotation); so
    does it where the model hands no rotary embedding (a transformers that rotated inside the attention)."""
    if not fused_linear.ROW_PRODUCTS[0] or position_embeddings is None:
        return super(type(self), self).forward(hidden_states=hidden_states, position_embeddings=position_embeddings,
                                               attention_mask=attention_mask, **kwargs)
    cache = kwargs.pop("cache", None)
    cache = kwargs.pop("past_key_values", None) if cache is None else cache
    input_shape = hidden_states.shape[:-1]
    fused = self.q_proj.fused
    layer = cache.layers[self.layer_idx] if isinstance(cache, SlotCache) else None
    target = None  # with KV_WRITES, where the kernel writes the new key and value itself
    if layer is not None and fused_linear.KV_WRITES[0] and fused.linear.in_kernel(hidden_states):
        target = layer.write_target()
    qkv = fused.linear(hidden_states, rope=position_embeddings, cache=target)
    query, key, value = (qkv.narrow(-1, start, size).view(*input_shape, -1, self.head_dim).transpose(1, 2)
                         for start, size in fused.spans)
    if target is not None:
        key, value = layer.view(key.shape[0])
    elif cache is not None:
        key, value = cache.update(key, value, self.layer_idx)
    implementation = self.config._attn_implementation
    eager = self._hf_module.eager_attention_forward
    interface = (ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager)
                 if hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface")
                 else eager if implementation == "eager" else ALL_ATTENTION_FUNCTIONS[implementation])
    window = WINDOWS[self._hf_name](self)
    out, weights = interface(self, query, key, value, attention_mask,
                             dropout=self.attention_dropout if self.training else 0.0, scaling=self.scaling,
                             **({} if window is None else {"sliding_window": window}), **kwargs)
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


_FOLDED_CLASSES: dict[type, type] = {}


def _folded_class(cls: type, forward=folded_forward) -> type:
    """`cls` with `forward`: the module keeps its type for isinstance and its attributes as they are, and knows
    its class's name and Hugging Face module (where its eager attention lives)."""
    if cls not in _FOLDED_CLASSES:
        _FOLDED_CLASSES[cls] = type(f"Folded{cls.__name__}", (cls,), {
            "forward": forward, "_hf_name": cls.__name__, "_hf_module": sys.modules[cls.__module__]})
    return _FOLDED_CLASSES[cls]


def _rope_foldable(attention: torch.nn.Module) -> bool:
    """q, k and v one stacked product's three parts, in that order, and a known attention over whole heads."""
    parts = [getattr(attention, name, None) for name in ("q_proj", "k_proj", "v_proj")]
    return (type(attention).__name__ in WINDOWS and all(isinstance(part, FusedPart) for part in parts)
            and len({id(part.fused) for part in parts}) == 1 and len(parts[0].fused.spans) == 3
            and [part.index for part in parts] == [0, 1, 2]
            and all(span[1] % attention.head_dim == 0 for span in parts[0].fused.spans))


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
        if _rope_foldable(attention):
            product = attention.q_proj.fused.linear
            product.rope_columns = sum(size for _, size in attention.q_proj.fused.spans[:2])
            product.kv_columns = attention.q_proj.fused.spans[1][1]
            product.head_dim = attention.head_dim
            attention.__class__ = _folded_class(type(attention), folded_attention_forward)
        attention.o_proj = _stacked(attention.o_proj)
        layer.mlp = FoldedMLP(mlp.gate_proj.fused.linear, _stacked(mlp.down_proj))
        layer.input_layernorm = torch.nn.Identity()
        layer.post_attention_layernorm = torch.nn.Identity()
        layer.__class__ = _folded_class(type(layer))
        folded += 1
    return folded
