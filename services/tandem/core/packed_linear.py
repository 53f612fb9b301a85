"""Linear layers on oneDNN with prepacked weights: the CPU decode path at the memory-bandwidth limit.

A decode step multiplies a few rows of activations by every weight of the model once, so its speed is the speed at
which the weights stream from memory. PyTorch's own bf16 linear on CPU hands oneDNN the weight in its plain
[out, in] layout on every call, and oneDNN reorders it on the fly: measured here (2 cores, 28 layers of the 1.5B
target's MLP, one row) 31 GB/s against 47 GB/s with the weight reordered once, ahead of time, into oneDNN's blocked
layout (`mkldnn::_reorder_linear_weight`, the same op torch.compile's inductor uses for frozen weights). The products
are the same oneDNN kernels over the same numbers: outputs are bit-identical to nn.Linear in bf16, which is why only
bf16 is packed (float32 linears go through another BLAS whose rounding differs, and float32 is where exactness is
tested against Hugging Face's generate).

`prepack(model)` swaps every nn.Linear of a CPU bf16 model for a PackedLinear holding only the packed weight, so
memory stays what it was, except for an output head whose weight is tied to the input embedding (the embedding keeps
the plain copy for its lookups). The model stays a plain Hugging Face module for anything that calls it.
oneDNN packs bf16 weights only on CPUs with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; elsewhere (an AVX2-only CPU)
`supported()` is False and models stay eager.
"""

from __future__ import annotations

import functools

import torch

PACKABLE_DTYPES = (torch.bfloat16,)


class PackedLinear(torch.nn.Module):
    """y = x W^T + b with W held in oneDNN's layout; inference only (no gradient flows to W)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight_bytes = weight.numel() * weight.element_size()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = None if bias is None else bias.detach()

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> PackedLinear:
        return cls(linear.weight, linear.bias)

    def first_rows(self, rows: int) -> PackedLinear:
        """The projection onto the first `rows` outputs only (a drafter scoring part of the vocabulary)."""
        bias = None if self.bias is None else self.bias[:rows]
        return PackedLinear(self.packed.to_dense()[:rows], bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@functools.cache
def supported() -> bool:
    """Whether this CPU and torch build can pack bf16 weights: asked of oneDNN itself, once (the instruction sets
    it needs are its business, and differ between its versions)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), None)
    except RuntimeError:
        return False
    return True


def packable(model: torch.nn.Module) -> bool:
    """Whether prepack would change this model: bf16 on CPU, a CPU oneDNN packs bf16 on, and not a tensor-parallel
    shard (those linears are wrapped by the parallel plan and must stay as they are)."""
    parameter = next(model.parameters())
    sharded = torch.distributed.is_available() and torch.distributed.is_initialized()
    return (parameter.device.type == "cpu" and parameter.dtype in PACKABLE_DTYPES and supported() and not sharded)


def prepack(model: torch.nn.Module) -> int:
    """Replace the model's nn.Linear layers by PackedLinear in place; the number replaced (0 when not packable, or
    when already packed, so calling it twice is harmless)."""
    if not packable(model):
        return 0
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is torch.nn.Linear]
    with torch.no_grad():
        for parent, name, child in swaps:
            setattr(parent, name, PackedLinear.from_linear(child))
    return len(swaps)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of linear-layer weights one forward reads, packed, int8 (core.int8_linear) or plain: what a decode step
    streams from memory (the embedding lookup reads a row per token, the norms are small)."""
    total = 0
    for module in model.modules():
        if hasattr(module, "weight_bytes"):  # PackedLinear, Int8Linear
            total += module.weight_bytes
        elif isinstance(module, torch.nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
    return total
