"""Int8 weights and int8 activations for the draft model on a CPU: oneDNN's int8 GEMM, one scale per row of each.

A draft step streams every weight of the draft once (core.packed_linear), so halving the bytes halves its cost, if
the kernel keeps up. PyTorch's weight-only int8 kernel (core.int8_linear) widens every weight to the activations'
dtype on the fly, which on an AVX-512/AMX CPU costs more than the bytes it saves as a step's rows grow. oneDNN's
int8 GEMM multiplies int8 by int8 into int32 (AMX or VNNI instructions) and streams the half-size weights at the
rate bf16 weights stream, so the 0.5B draft's products take about 0.55 of their prepacked bf16 time. The rest of a
forward stays as it was: a whole draft forward of one token runs 1.25x on a 2-core AMX Xeon and 1.26x on an
AVX-512 EPYC (docs/performance.md).

The activations are quantized at each call, one scale per row (its largest magnitude over 127, or over 63 on a CPU
without VNNI: activation_levels), so a row's product does not depend on the step's other rows and an outlier token of
a prefill coarsens only its own row. The int32 products are exact; the row and weight scales are applied in float32
afterwards.

Only drafts are quantized: the target's verification decides every emitted token, so the coarser draft can lower
the acceptance rate but never changes the output (lossless, and seeded requests give plain decoding's tokens).
"""

from __future__ import annotations

import functools

import torch

from tandem.core.fused_linear import fuse
from tandem.core.packed_linear import fixed_size, replace_linears

# oneDNN picks a slow kernel for one row against a narrow weight (a [128 x 896] layer: 2 ms for one row, 35 us for
# five): such rows run as two.
NARROW = 1024
_ONE = torch.tensor(1.0)
# Activations go to oneDNN as uint8 levels + offset with the offset as zero point, the layout its x86 int8 kernels
# take (VNNI multiplies uint8 by int8). As int8, a CPU with VNNI but no AMX ran oneDNN's reference kernel: 92 ms for
# 8 rows of a [1152 x 896] product, against 0.16 ms as uint8 (a 2-core AVX-512 EPYC).
#
# A CPU without VNNI (AVX2 only) multiplies with vpmaddubsw, which adds each pair of uint8 x int8 products into a
# saturating int16: levels up to 255 against weights up to 127 overflow it (sums off by 4e4 on an AVX2 EPYC). There
# the activations take 7 bits, uint8 levels up to 127 (pairs stay under 2^15), as fbgemm's reduce_range does.
FULL_LEVELS, REDUCED_LEVELS = 127, 63


def _gemm(levels: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero_points: torch.Tensor,
          offset: int) -> torch.Tensor:
    # x scale 1 and zero point `offset`: the int32 products of the signed levels times the weight's row scales, in
    # float32.
    return torch.ops.onednn.qlinear_pointwise.tensor(levels, _ONE, _offset_tensor(offset), packed, scale,
                                                     zero_points, None, 1.0, 0, torch.float32, "none", [None], "")


@functools.cache
def _offset_tensor(offset: int) -> torch.Tensor:
    return torch.tensor(offset, dtype=torch.int64)


@functools.cache
def activation_levels() -> int:
    """The largest activation level (in magnitude) whose products oneDNN's int8 GEMM sums exactly on this CPU: 127,
    or 63 where its kernel saturates pairs in int16 (see REDUCED_LEVELS). Asked of the kernel, once, with the worst
    case: every activation and weight at its largest level."""
    columns = 64
    packed = torch.ops.onednn.qlinear_prepack(torch.full((1, columns), 127, dtype=torch.int8), [1, columns])
    top = torch.full((2, columns), FULL_LEVELS + FULL_LEVELS + 1, dtype=torch.uint8)
    y = _gemm(top, packed, torch.ones(1), torch.zeros(1, dtype=torch.int64), FULL_LEVELS + 1)
    return FULL_LEVELS if bool((y == FULL_LEVELS * 127 * columns).all()) else REDUCED_LEVELS


@torch.library.custom_op("tandem::onednn_int8_gemm", mutates_args=())
def onednn_int8_gemm(levels: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                     zero_points: torch.Tensor, offset: int) -> torch.Tensor:
    """oneDNN's int8 GEMM as one opaque op for torch.compile, which fuses the quantizing and scaling around it (as
    core.packed_linear's onednn_linear); eager forwards call it directly."""
    return _gemm(levels, packed, scale, zero_points, offset)


@onednn_int8_gemm.register_fake
def _onednn_int8_gemm_shape(levels: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                            zero_points: torch.Tensor, offset: int) -> torch.Tensor:
    return levels.new_empty((levels.shape[0], scale.shape[0]), dtype=torch.float32)


@functools.cache
def lower_to_onednn() -> None:
    """Have inductor's generated code call oneDNN's int8 GEMM itself where the op stands, rather than through this
    op's Python kernel, as core.packed_linear.lower_to_onednn does for the packed product: a one-row compiled forward
    of the w8a8 0.5B draft ran 1.070-1.075x faster so, 3-5 ms over its 96 products (docs/performance.md). The scalar
    overload takes the activations' scale and zero point as constants, so no module-level tensor enters the graph
    (the same products, bit for bit). Call before compiling."""
    from torch._inductor.lowering import fallback_handler, register_lowering

    direct = fallback_handler(torch.ops.onednn.qlinear_pointwise.default, add_to_fallback_set=False)

    @register_lowering(torch.ops.tandem.onednn_int8_gemm.default, type_promotion_kind=None)
    def _lowered(levels, packed, scale, zero_points, offset):
        return direct(levels, 1.0, offset, packed, scale, zero_points, None, 1.0, 0, torch.float32, "none", [None], "")


def _product(x: torch.Tensor, gemm, packed: torch.Tensor, scale: torch.Tensor, zero_points: torch.Tensor,
             bias: torch.Tensor | None, top: int) -> torch.Tensor:
    out_features = scale.shape[0]
    rows = x.reshape(-1, x.shape[-1]).float()
    lone = rows.shape[0] == 1 and out_features < NARROW
    if lone:
        rows = rows.expand(2, -1)
    row_scale = rows.abs().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / top
    y = gemm((torch.round(rows / row_scale) + (top + 1)).to(torch.uint8), packed, scale, zero_points, top + 1)
    y = y * row_scale if bias is None else torch.addcmul(bias, y, row_scale)
    if lone:
        y = y[:1]
    return y.to(x.dtype).reshape(*x.shape[:-1], out_features)


# Weights are quantized this many elements at a time (8 MB of float32): each elementwise pass over a whole layer
# streamed it from memory, and a 0.5B draft's passes took 3-4x as long as over rows that stay in cache.
CHUNK_ELEMENTS = 1 << 21


def int8_levels(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q (int8) and s (float32, one per output row) of a [out, in] weight: symmetric, s = max|W_row| / 127 and
    Q = round(W / s), computed a few rows at a time."""
    out_features, in_features = weight.shape
    levels = torch.empty(out_features, in_features, dtype=torch.int8)
    scale = torch.empty(out_features)
    step = max(1, CHUNK_ELEMENTS // max(in_features, 1))
    for start in range(0, out_features, step):
        rows = weight[start : start + step].detach().to(torch.float32, copy=True)
        row_scale = (rows.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
        levels[start : start + step] = torch.round(rows.div_(row_scale[:, None])).clamp_(-127, 127)
        scale[start : start + step] = row_scale
    return levels, scale


class W8A8Linear(torch.nn.Module):
    """y = (x quantized per row) (s * Q)^T + b: Q int8 [out, in] with s one float32 scale per output row
    (symmetric, s = max|W_row| / 127), held in oneDNN's int8 layout; inference only. `quantized`: Q and s as
    int8_levels gives them, where the caller has them already."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        levels, self.scale = quantized if quantized is not None else int8_levels(weight)
        self.packed = torch.ops.onednn.qlinear_prepack(levels, [1, self.in_features])
        self.zero_points = torch.zeros(self.out_features, dtype=torch.int64)
        self.bias = None if bias is None else bias.detach().float()
        fixed_size(self.packed, self.scale, self.zero_points, self.bias)
        self.weight_bytes = levels.numel() + self.scale.numel() * self.scale.element_size()
        # Each row's activations are quantized to the levels -top..top (activation_levels).
        self.top = activation_levels()

    @classmethod
    def from_linear(cls, linear: torch.nn.Module) -> W8A8Linear:
        return cls(linear.weight, linear.bias)

    def dequantized(self) -> torch.Tensor:
        """The weight this layer multiplies by, in float32, recovered through the product itself (the packed layout
        is oneDNN's business): the identity's rows, which quantize exactly, pick out the weight's columns."""
        identity = (torch.eye(self.in_features) + (self.top + 1)).to(torch.uint8)
        return _gemm(identity, self.packed, self.scale, self.zero_points, self.top + 1).t().contiguous()

    def first_rows(self, rows: int) -> W8A8Linear:
        """The projection onto the first `rows` outputs only (a drafter scoring part of the vocabulary); the levels
        and scales are the same, since each output row is quantized on its own."""
        return W8A8Linear(self.dequantized()[:rows], None if self.bias is None else self.bias[:rows])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gemm = onednn_int8_gemm if torch.compiler.is_compiling() else _gemm
        return _product(x, gemm, self.packed, self.scale, self.zero_points, self.bias, self.top)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@functools.cache
def supported() -> bool:
    """Whether this CPU and torch build run oneDNN's int8 GEMM: asked of oneDNN itself, once."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        W8A8Linear(torch.ones(16, 16), None)(torch.ones(2, 16))
    except (RuntimeError, AttributeError):
        return False
    return True


def refusal(device: torch.device) -> str | None:
    """Why w8a8 weights cannot be held on `device` in this process, None where they can."""
    if device.type != "cpu" or not supported():
        return f"oneDNN's int8 GEMM does not run on {device.type} here"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return "not with tensor parallelism (drafts run on one device)"
    return None


def quantize_w8a8(model: torch.nn.Module) -> int:
    """Replace the model's nn.Linear layers by W8A8Linear in place, siblings that read one input (q/k/v, gate/up)
    as parts of one product (core.fused_linear); the number of nn.Linear replaced. An output head tied to the input
    embedding gets its own int8 copy (the embedding keeps its weight for lookups)."""
    if (why := refusal(next(model.parameters()).device)) is not None:
        raise ValueError(f"w8a8 draft weights: {why}")
    return fuse(model, product=W8A8Linear) + replace_linears(model, W8A8Linear.from_linear)
