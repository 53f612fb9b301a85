"""Int4 draft weights for one-row draft steps, on top of the w8a8 layers (core.w8a8_linear) for wider ones.

At batch 1 a draft step is one row, and it streams every weight of the draft once: fewer bytes are a faster step if
the kernel keeps up. PyTorch's weight-only int4 kernel for CPUs (`aten::_weight_int4pack_mm_for_cpu`, the one
torchao's int4 CPU layout runs) widens each group of 4-bit levels to float as it streams them: at one row it ran
the 0.5B draft's 96 layer products in 7.0 ms against 12.8 for the w8a8 products and 14.8 for prepacked bf16 (2-core
AVX-512 EPYC, weights streamed from memory; docs/bench/int4-kernels-v1.json). The widening is arithmetic per row, so
from a few rows on it costs more than the bytes save (19.7 ms at 8 rows against 18.0 for w8a8). So each layer holds
both: the int4 levels for a step of one row, the w8a8 layer for anything wider (a batch's draft steps, a drafter's
catch-up, prefill). The int4 copy is half the size of the int8 one, so the draft's weights take 1.5x the memory of
w8a8 alone.

Levels are asymmetric per group of input columns (the largest of `GROUPS` that divides them: 128 for the Qwen pair):
each group's range split into 15 steps, the kernel's own scale-and-zero layout. They are quantized from the w8a8
layer's weight (its int8 levels times their row scale), so a layer is fully described by that one weight, and a slice
of its rows (`first_rows`, a smaller draft head) quantizes to the same levels as the whole.

Only drafts are quantized: the target's verification decides every emitted token, so the coarser draft can lower the
acceptance rate but never changes the output (lossless, and seeded requests give plain decoding's tokens).
"""

from __future__ import annotations

import torch

from tandem.core.fused_linear import fuse
from tandem.core.packed_linear import fixed_size, replace_linears
from tandem.core.w8a8_linear import CHUNK_ELEMENTS, W8A8Linear, int8_levels
from tandem.core.w8a8_linear import refusal as w8a8_refusal
from tandem.core.w8a8_linear import supported as w8a8_supported

KERNEL = "aten::_weight_int4pack_mm_for_cpu"
GROUPS = (128, 64, 32)  # columns per scale and zero point, the largest that divides a layer's inputs
LEVELS = 15
INNER_K_TILES = 2  # the packing's inner tiling of the input columns: 2 takes any multiple of 32 inputs
ROWS_ALIGN = 16  # the packing wants outputs in multiples of 16
# It packs blocks of 64 output rows (32 on AVX2) apart, [rows, in / 2] bytes: chunks of whole blocks pack as the whole.
PACK_ROWS = 64


def int4_group(in_features: int, out_features: int) -> int:
    """The group size a [out, in] weight is quantized with, 0 where the kernel cannot take its shape."""
    if out_features % ROWS_ALIGN:
        return 0
    return next((group for group in GROUPS if in_features % group == 0), 0)


def quantize_int4(levels: torch.Tensor, row_scale: torch.Tensor, group: int,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed levels and the [in / group, out, 2] scales and zero points (in `dtype`, the activations') of the
    w8a8 weight Q * s (int8 `levels`, each row scaled by `row_scale`): w ~ (level - 8) * scale + zero, the level in
    0..15. The rows are dequantized, quantized and packed PACK_ROWS-aligned chunks at a time, so no float or int32
    copy of the whole layer is made: for the 0.5B draft those were 2 GB each, written into fresh memory."""
    out_features, in_features = levels.shape
    packed = torch.empty(out_features, in_features // 2, dtype=torch.uint8)
    scale = torch.empty(out_features, in_features // group, 1)
    low = torch.empty_like(scale)
    step = max(1, CHUNK_ELEMENTS // in_features // PACK_ROWS) * PACK_ROWS  # so each pass over them stays in cache
    for start in range(0, out_features, step):
        rows = slice(start, start + step)
        groups = levels[rows].float().mul_(row_scale[rows, None]).reshape(-1, in_features // group, group)
        low[rows], high = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
        scale[rows] = ((high - low[rows]) / LEVELS).clamp(min=torch.finfo(torch.float32).tiny)
        int4 = torch.round((groups - low[rows]) / scale[rows]).clamp_(0, LEVELS).to(torch.int32)
        packed[rows] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(int4.reshape(-1, in_features), INNER_K_TILES)
    zero = low + 8 * scale
    scales_and_zeros = torch.stack([scale.squeeze(-1).t(), zero.squeeze(-1).t()], dim=-1).to(dtype).contiguous()
    return packed, scales_and_zeros


class W4Linear(torch.nn.Module):
    """A w8a8 layer (core.w8a8_linear) that multiplies one row by an int4 copy of its weight instead; inference only.
    `dtype`: the activations' dtype (the int4 kernel takes its scales in it)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        levels, scale = int8_levels(weight)
        self.wide = W8A8Linear(weight, bias, (levels, scale))
        self.out_features, self.in_features = self.wide.out_features, self.wide.in_features
        self.group = int4_group(self.in_features, self.out_features)
        if not self.group:
            raise ValueError(f"int4 weights need outputs in multiples of {ROWS_ALIGN} and inputs in multiples of "
                             f"{GROUPS[-1]}: got [{self.out_features} x {self.in_features}]")
        self.dtype = dtype or weight.dtype
        # From the w8a8 weight, Q * s: what self.wide.dequantized() recovers through the product, to the bit.
        self.packed, self.scales_and_zeros = quantize_int4(levels, scale, self.group, self.dtype)
        self.bias = None if bias is None else bias.detach().to(self.dtype)
        fixed_size(self.packed, self.scales_and_zeros, self.bias)
        # What a one-row step reads: the int4 levels and their scales and zero points.
        self.weight_bytes = self.packed.numel() + self.scales_and_zeros.numel() * self.scales_and_zeros.element_size()

    @classmethod
    def from_linear(cls, linear: torch.nn.Module) -> W4Linear:
        return cls(linear.weight, linear.bias)

    def first_rows(self, rows: int) -> W4Linear | W8A8Linear:
        """The projection onto the first `rows` outputs only (a drafter scoring part of the vocabulary); the w8a8
        layer's alone where the int4 packing cannot take that many rows."""
        if not int4_group(self.in_features, rows):
            return self.wide.first_rows(rows)
        bias = None if self.wide.bias is None else self.wide.bias[:rows]
        return W4Linear(self.wide.dequantized()[:rows], bias, self.dtype)

    def dequantized(self) -> torch.Tensor:
        """The weight a one-row step multiplies by, in float32, recovered through the product itself: the
        identity's rows pick out its columns."""
        identity = torch.eye(self.in_features, dtype=self.dtype)
        return self._int4(identity).float().t().contiguous()

    def _int4(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group, self.scales_and_zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A compiled graph knows whether its steps are one row: the one-row one-token shape class is compiled apart.
        if x.numel() != x.shape[-1] or x.dtype != self.dtype:
            return self.wide(x)
        y = self._int4(x.reshape(1, self.in_features)).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}, "
                f"bias={self.bias is not None}")


def supported() -> bool:
    """Whether this torch build has the int4 CPU kernel and oneDNN's int8 GEMM (asked of the dispatcher and oneDNN)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(KERNEL, "CPU") and w8a8_supported()


def refusal(device: torch.device) -> str | None:
    """Why w4 weights cannot be held on `device` in this process, None where they can."""
    if device.type != "cpu" or not supported():
        return f"the int4 and int8 CPU kernels do not run on {device.type} here"
    return w8a8_refusal(device)


def quantize_w4(model: torch.nn.Module) -> int:
    """Replace the model's nn.Linear layers by W4Linear in place (q/k/v and gate/up as parts of one product each,
    core.fused_linear); a layer whose shape the int4 packing cannot take becomes a plain W8A8Linear. The number of
    nn.Linear replaced."""
    parameter = next(model.parameters())
    if (why := refusal(parameter.device)) is not None:
        raise ValueError(f"w4 draft weights: {why}")
    dtype = parameter.dtype

    def make(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.nn.Module:
        if int4_group(weight.shape[1], weight.shape[0]):
            return W4Linear(weight, bias, dtype)
        return W8A8Linear(weight, bias)

    return fuse(model, product=make) + replace_linears(model, lambda linear: make(linear.weight, linear.bias))
