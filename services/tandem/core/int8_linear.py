"""Weight-only int8 linear layers for the draft model: half the bytes a draft step streams, same output distribution.

A decode step's cost is the weights it reads (core.packed_linear says why). The draft only proposes: the target's
verification decides every emitted token, so a coarser draft can lower the acceptance rate but never changes what
the engine outputs (lossless, and seeded requests still give plain decoding's tokens). Storing the draft's linear
weights as int8 with one scale per output row halves what a draft step reads. The product runs in PyTorch's own
weight-only int8 kernel (`aten::_weight_int8pack_mm`, the one gpt-fast and torchao use), activations staying in the
model's dtype. Measured on a 2-core AVX2 CPU (bf16, one row): the 0.5B draft's forward 215 ms -> 116-140 ms.

Only drafts are quantized: the target's logits are the distribution the engine reproduces.
"""

from __future__ import annotations

import torch

from tandem.core.packed_linear import replace_linears

KERNEL = "aten::_weight_int8pack_mm"


class Int8Linear(torch.nn.Module):
    """y = x (s * Q)^T + b, Q int8 [out, in] and s one scale per output row (symmetric: s = max|W_row| / 127)."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.qweight, self.scale, self.bias = qweight.contiguous(), scale.contiguous(), bias

    @classmethod
    def from_linear(cls, linear: torch.nn.Module) -> Int8Linear:
        w = linear.weight.detach().float()
        # The scale is held in the activations' dtype (the kernel's demand); levels are rounded against that held
        # scale, so each weight ends within half a step of its original.
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny).to(linear.weight.dtype)
        levels = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(levels, scale, None if linear.bias is None else linear.bias.detach())

    @property
    def weight_bytes(self) -> int:
        """What a forward reads of this layer's weights (core.packed_linear.weight_bytes)."""
        return self.qweight.numel() + self.scale.numel() * self.scale.element_size()

    def first_rows(self, rows: int) -> Int8Linear:
        """The projection onto the first `rows` outputs only (a drafter scoring part of the vocabulary)."""
        return Int8Linear(self.qweight[:rows], self.scale[:rows], None if self.bias is None else self.bias[:rows])

    def dequantized(self) -> torch.Tensor:
        """The weight this layer multiplies by, in the activations' dtype (for tests and reports)."""
        return (self.qweight.float() * self.scale.float()[:, None]).to(self.scale.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        y = torch._weight_int8pack_mm(rows, self.qweight, self.scale).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def supported(device: torch.device) -> bool:
    """Whether this torch build has the int8 kernel for `device` (CPU builds do; asked of the dispatcher)."""
    key = {"cpu": "CPU", "cuda": "CUDA", "mps": "MPS"}.get(device.type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(KERNEL, key)


def quantize_int8(model: torch.nn.Module) -> int:
    """Replace the model's nn.Linear layers by Int8Linear in place; the number replaced. An output head tied to the
    input embedding gets its own int8 copy (the embedding keeps its weight for lookups)."""
    parameter = next(model.parameters())
    if not supported(parameter.device):
        raise ValueError(f"int8 draft weights: this torch build has no {KERNEL} kernel for {parameter.device.type}")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        raise ValueError("int8 draft weights: not with tensor parallelism (drafts run on one device)")
    return replace_linears(model, Int8Linear.from_linear)
