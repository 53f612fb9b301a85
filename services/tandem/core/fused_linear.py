"""Sibling linears that read the same input run as one product: a layer's q/k/v, an MLP's gate/up.

A decode step streams every weight once (core.packed_linear), and each oneDNN call has a cost of its own beside the
bytes it reads: the 1.5B target's 256-row k and v projections stream at well under the rate its MLP does. One call
over the stacked weights reads them in one pass, as vLLM's merged projections do. On a GPU a batch-1 decode step is
a chain of small kernels, each with a launch and a tail of its own, so there the stacked product (a plain linear,
StackedLinear) runs two kernels per layer where the siblings ran five (`stack_on_gpu`).

Hugging Face's modules call q_proj(x), k_proj(x) and v_proj(x) in turn on the same x, and gate_proj(x) and up_proj(x)
likewise, so those modules stay as Hugging Face wrote them: each projection becomes a FusedPart of one FusedLinear.
Whichever part is called first computes the stacked product and keeps it until each part has taken its columns (a
view); a part called on another input, or a second time, computes afresh. So any call order gives the right numbers,
and nothing is kept after the last part has read.

On a GPU `stack_on_gpu` also folds each decoder layer (core.folded_layers): its norms, residual adds and activation
move into StackedLinears, so that with ROW_PRODUCTS on a one-row product runs them all inside one Triton kernel
(core.triton_gemv). Off (the default until a GPU sitting times it), a folded product runs the same ops in torch
around cuBLAS (`TANDEM_GPU_ROW_PRODUCTS=1` turns it on).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from tandem.core.mapped_pages import MappedWeights
from tandem.core.packed_linear import PackedLinear

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_ROW_PRODUCTS_ENV = os.environ.get("TANDEM_GPU_ROW_PRODUCTS", "0")
if _ROW_PRODUCTS_ENV not in ("0", "1"):
    raise ValueError(f"TANDEM_GPU_ROW_PRODUCTS: 0 or 1, got {_ROW_PRODUCTS_ENV!r}")
ROW_PRODUCTS: list[bool] = [_ROW_PRODUCTS_ENV == "1"]  # a cell: compiled forwards read it as they trace
ROW_DEVICES = ("cuda",)  # where the Triton kernel runs; the tests add "cpu", where Triton's interpreter runs it
# A cell: with ROW_PRODUCTS, a folded attention's one-row q/k/v kernel also writes the new key and value into the
# cache (core.folded_layers) instead of a kernel of its own. Off until a GPU sitting times it (whether inductor keeps
# the buffers in place around a kernel that writes them is what it would show).
KV_WRITES: list[bool] = [False]
# Weight shapes (N, K) whose one-row product stays cuBLAS's with ROW_PRODUCTS on (its folded work then runs in torch
# around it): where tandem.bench.row_products finds cuBLAS faster than the kernel at its best tile.
CUBLAS_SHAPES: set[tuple[int, int]] = set()
# What builds a stacked product from its weight and bias: a layer class (PackedLinear, StackedLinear, W8A8Linear) or a
# function that picks one (core.w4_linear's).
Product = Callable[[torch.Tensor, torch.Tensor | None], torch.nn.Module]


def rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm (RMS_NORMS), op for op: the statistics in float32, rounded back before the gain."""
    x32 = x.to(torch.float32)
    return gain * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate(out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, columns: int, head: int) -> torch.Tensor:
    """Hugging Face's apply_rotary_pos_emb, op for op, on the first `columns` of a product's output [..., N] (heads
    of `head`, q's then k's), cos and sin [..., head] per position: x cos + rotate_half(x) sin."""
    heads = out[..., :columns].unflatten(-1, (-1, head))
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    first, second = heads[..., : head // 2], heads[..., head // 2 :]
    turned = heads * cos + torch.cat((-second, first), dim=-1) * sin
    return torch.cat((turned.flatten(-2), out[..., columns:]), dim=-1)


class StackedLinear(torch.nn.Module):
    """The stacked weight as a plain linear layer (cuBLAS on a GPU); inference only. Where core.folded_layers
    folded a layer, it also runs what surrounds the product there: the RMSNorm in front of it (`norm`, `eps`), the
    activation (`gated`: silu of the input's first half times its second) and the residual add after it
    (`residual`, or one left in `residual_cell` by the layer, for a product called by code that passes none). One
    row runs core.triton_gemv's kernel, all of that inside it, where ROW_PRODUCTS says."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.weight_bytes = weight.numel() * weight.element_size()
        self.norm: torch.nn.Parameter | None = None  # a folded RMSNorm's gain, and its epsilon
        self.eps = 0.0
        self.residual_cell: list[torch.Tensor | None] = [None]  # a list cell: dynamo traces its writes and reads
        self.rope_columns, self.head_dim = 0, 0  # a folded rotary embedding's columns (q's and k's) and head size
        self.kv_columns = 0  # of those, k's (a folded attention's q/k/v; as many follow for v)

    def in_kernel(self, x: torch.Tensor) -> bool:
        """Whether a call on `x` runs core.triton_gemv's kernel: one row, where ROW_PRODUCTS says. Under
        torch.compile a size of 1 is a plain int (dynamo specialises it) and any other is symbolic, so this reads no
        symbol and adds no guard beyond the shape class the graph already has."""
        one_row = all(type(size) is int and size == 1 for size in x.shape[:-1])
        return (ROW_PRODUCTS[0] and one_row and x.device.type in ROW_DEVICES and x.dtype == self.weight.dtype
                and tuple(self.weight.shape) not in CUBLAS_SHAPES)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, gated: bool = False,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """`rope`: the positions' (cos, sin), for a product whose rope_columns are set (a folded attention's q/k/v);
        `cache`: a layer's (keys, values, slot, position) that the kernel writes k's and v's columns into, given
        only where `in_kernel`."""
        if residual is None:
            residual, self.residual_cell[0] = self.residual_cell[0], None
        if self.in_kernel(x):
            from tandem.core.triton_gemv import row_product  # Triton is there only where it runs

            turns = None if rope is None else (*rope, self.rope_columns, self.head_dim)
            into = None if cache is None else (*cache, self.rope_columns - self.kv_columns)
            return row_product(x, self.weight, self.bias, self.norm, self.eps, residual, gated, turns, into)
        if cache is not None:
            raise ValueError("a cache to write into is for the one-row kernel only (in_kernel)")
        return self.in_torch(x, residual, gated, rope)

    def in_torch(self, x: torch.Tensor, residual: torch.Tensor | None = None, gated: bool = False,
                 rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The folded product as torch ops around F.linear, Hugging Face's layer op for op: what runs wherever the
        kernel does not, and what the kernel is measured against."""
        if self.norm is not None:
            x = rms_norm(x, self.norm, self.eps)
        if gated:
            gate, up = x.chunk(2, dim=-1)
            x = torch.nn.functional.silu(gate) * up
        out = torch.nn.functional.linear(x, self.weight, self.bias)
        if rope is not None:
            out = rotate(out, *rope, self.rope_columns, self.head_dim)
        return out if residual is None else residual + out

    def extra_repr(self) -> str:
        return (f"{tuple(self.weight.shape)}, folded norm: {self.norm is not None}, "
                f"rotated columns: {self.rope_columns}")


class FusedLinear(torch.nn.Module):
    """y = x [W_1; W_2; ...]^T + [b_1; b_2; ...], computed once per input for the parts that slice it."""

    def __init__(self, linears: list[torch.nn.Linear], product: Product = PackedLinear) -> None:
        super().__init__()
        weight = torch.cat([linear.weight.detach() for linear in linears])
        biases = [linear.bias for linear in linears]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b.detach() if b is not None else linear.weight.new_zeros(linear.out_features)
                              for b, linear in zip(biases, linears, strict=True)])
        self.linear = product(weight, bias)
        sizes = [linear.out_features for linear in linears]
        self.spans = [(sum(sizes[:i]), size) for i, size in enumerate(sizes)]
        # [(input, its product, parts yet to read it)]: the triple is replaced whole, so a reader sees one consistent
        # one; a list cell rather than a module attribute, whose assignment nn.Module makes slow.
        self._kept: list[tuple[torch.Tensor, torch.Tensor, frozenset[int]] | None] = [None]

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        kept = self._kept[0]
        if kept is None or kept[0] is not x or index not in kept[2]:
            kept = (x, self.linear(x), frozenset(range(len(self.spans))))
        left = kept[2] - {index}
        self._kept[0] = (x, kept[1], left) if left else None
        start, size = self.spans[index]
        return kept[1].narrow(-1, start, size)


class FusedPart(torch.nn.Module):
    """One projection's columns of a FusedLinear, standing where its nn.Linear stood."""

    def __init__(self, fused: FusedLinear, index: int, in_features: int) -> None:
        super().__init__()
        self.fused, self.index = fused, index
        self.in_features, self.out_features = in_features, fused.spans[index][1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.part(self.index, x)

    def extra_repr(self) -> str:
        return f"part {self.index} of {len(self.fused.spans)}, out_features={self.out_features}"


def fuse(model: torch.nn.Module, least: int = 0, product: Product = PackedLinear,
         takes: Callable[[int], bool] | None = None) -> int:
    """Replace each GROUPS set of nn.Linear siblings (same input width and dtype, at least `least` weights together,
    their outputs together a count `takes` accepts) by parts of one FusedLinear whose stacked product `product`
    builds (PackedLinear, StackedLinear, core.w8a8_linear's W8A8Linear, core.w4_linear's choice), in place; the
    number of nn.Linear replaced."""
    replaced, mapped = 0, MappedWeights(model)
    for module in list(model.modules()):
        for names in GROUPS:
            linears = [getattr(module, name, None) for name in names]
            if not all(type(linear) is torch.nn.Linear for linear in linears):
                continue
            if len({(linear.in_features, linear.weight.dtype) for linear in linears}) != 1:
                continue
            if sum(linear.weight.numel() for linear in linears) < least:
                continue
            if takes is not None and not takes(sum(linear.out_features for linear in linears)):
                continue
            with torch.no_grad():
                fused = FusedLinear(linears, product)
            for index, (name, linear) in enumerate(zip(names, linears, strict=True)):
                setattr(module, name, FusedPart(fused, index, linear.in_features))
            for linear in linears:  # the product holds copies: the checkpoint's pages they were read from can go
                mapped.dropped(linear)
            replaced += len(linears)
    return replaced


def stack_on_gpu(model: torch.nn.Module) -> int:
    """fuse() with StackedLinear products for a model on a GPU, then core.folded_layers.fold_layers, unless it is a
    tensor-parallel shard (whose linears the parallel plan wraps); the number of nn.Linear replaced by fuse(), 0
    elsewhere."""
    from tandem.core.folded_layers import fold_layers  # which builds on this module's products

    sharded = torch.distributed.is_available() and torch.distributed.is_initialized()
    if next(model.parameters()).device.type != "cuda" or sharded:
        return 0
    replaced = fuse(model, product=StackedLinear)
    fold_layers(model)
    return replaced
