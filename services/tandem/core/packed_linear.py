"""Linear layers on oneDNN with prepacked weights: the CPU decode path at the memory-bandwidth limit.

A decode step multiplies a few rows of activations by every weight of the model once, so its speed is the speed at
which the weights stream from memory. PyTorch's own linear on CPU hands its BLAS the weight in its plain [out, in]
layout on every call; oneDNN with the weight reordered once, ahead of time, into its blocked layout
(`mkldnn::_reorder_linear_weight`, the same op torch.compile's inductor uses for frozen weights) streams it faster
and, above all, reads it once for all the rows of a step:
- bf16, on CPUs with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT: 47 GB/s against 31 GB/s for nn.Linear (2 cores, the
  1.5B target's MLP, one row), and bit-identical to nn.Linear, which runs the same oneDNN kernel unpacked.
- float32, on any x86 CPU oneDNN runs on. Where bf16 is not fast (AVX2 only, tandem's bf16 kernel not built)
  float32 is what `--dtype auto` picks, and there PyTorch's BLAS re-reads the weight for every row of a narrow
  step: one [8960 x 1536] layer takes 5.6 ms at 1 row, 29 ms at 5, 76 ms at 64, against 4.2, 6.0 and 51 ms packed
  (2-core AVX2 EPYC, a one-off timing;
  `tandem.bench.draft_weights` records the packed float32, bf16 and int8 kernels by row count). The products round
  differently from nn.Linear's (up to 2e-4 on that layer), the same for a row whatever the step's other rows (a
  lone row runs as two, since oneDNN's one-row kernel rounds otherwise), so speculative verification stays exact:
  every path of a loaded model runs the packed layers, Hugging Face's own generate included. In bf16 on an AMX CPU
  nn.Linear's own result depends on the row count, and the packed layer's equals it at every count.

On an AVX-512 or AVX2 CPU without AMX, bf16 layers whose outputs are a multiple of 32 take tandem's own product
instead (core.bf16_linear; `tiled`): oneDNN's bf16 product runs by dot products that such an AVX-512 CPU may run at a
quarter of its float32 multiply-adds' rate, so from 2 rows on it falls behind the weights' stream (8 rows took 1.8x
one row's time, 1.5x the kernel's), and on an AVX2 CPU oneDNN packs no bf16; where the CPU runs those dot products
fast (a Zen 4 EPYC) the kernel multiplies by them too (its DOT path, probed at load). Its rows are as independent of
their step mates, but its sums run in another order, so its values are not nn.Linear's bit for bit.

`prepack(model)` swaps every nn.Linear of a CPU model in a packable dtype (in float32, every large one) for a
PackedLinear holding only the packed weight, so memory stays what it was, except for an output head whose weight is
tied to the input embedding (the embedding keeps the plain copy for its lookups). The model stays a plain Hugging
Face module for anything that calls it. Where oneDNN cannot pack a dtype (bf16 on an AVX2-only CPU),
`supported(dtype)` is False: there bf16 layers take tandem's kernel (its AVX2 path) where it fits, and the rest stay
as they are.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from tandem.core import bf16_linear
from tandem.core.mapped_pages import MappedWeights

PACKABLE_DTYPES = (torch.bfloat16, torch.float32)
# Float32 layers with fewer weights stay on PyTorch's BLAS, whose per-call cost is lower: at one row a [256 x 1536]
# layer takes 0.12 ms packed against 0.05 ms, a [1536 x 1536] one 1.01 against 1.09 (2-core AVX2 EPYC).
MIN_PACKED_WEIGHTS = {torch.bfloat16: 0, torch.float32: 1 << 20}


def fixed_size(*tensors: torch.Tensor | None) -> None:
    """Tell torch.compile that these tensors of a layer (its packed weight, scales, bias) never change size. Held as
    plain attributes, not parameters, they would each get symbolic sizes under dynamic shapes, and every compiled
    forward would read and check hundreds of sizes that never change (360 of the 458 sizes a forward of the 0.5B w8a8
    draft read)."""
    for tensor in tensors:
        if tensor is not None:
            torch._dynamo.mark_static(tensor)


def _product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    if x.dtype == torch.float32 and x.numel() == x.shape[-1]:
        # One row: oneDNN would take its matrix-vector kernel, which rounds differently from the kernel every wider
        # step takes (seen on an AVX-512/AMX Xeon), and a plain decode step would then part from a verify forward.
        # Two identical rows take the wide kernel; the weights are still read once.
        both = torch.ops.mkldnn._linear_pointwise(x.reshape(1, -1).expand(2, -1).contiguous(), packed, bias, "none",
                                                   [], "")
        return both[:1].reshape(*x.shape[:-1], out_features)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@torch.library.custom_op("tandem::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """The packed product as one opaque op for torch.compile, which calls it between the elementwise kernels it
    fuses. Inductor's own lowering of mkldnn._linear_pointwise asserts on a bf16 weight it did not pack itself (a
    LoweringException, after which a compiled CPU forward of a packed bf16 model runs uncompiled), and its oneDNN
    fusion pass would fold a residual add into the product and hit the same assert. Eager forwards call the product
    directly: the dispatcher's per-call cost would show in a decode step of ~200 products."""
    return _product(x, packed, bias, out_features)


@onednn_linear.register_fake
def _onednn_linear_shape(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                         out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


@functools.cache
def lower_to_onednn() -> None:
    """Have inductor's generated code call oneDNN's product itself where the op stands, rather than through this op's
    Python kernel (the custom op's dispatch, alias checks and Python frames): a one-row forward of the 1.5B target
    ran 1.025-1.030x faster so, 4-6 ms over its 112 products (docs/performance.md). The op stays opaque to inductor's
    graph passes, so nothing fuses into the product. Float32 keeps the Python kernel: its one-row case (_product)
    depends on the row count, which a graph compiled for dynamic shapes does not know. Call before compiling."""
    from torch._inductor.lowering import fallback_handler, register_lowering

    direct = fallback_handler(torch.ops.mkldnn._linear_pointwise.default, add_to_fallback_set=False)
    opaque = fallback_handler(torch.ops.tandem.onednn_linear.default, add_to_fallback_set=False)

    @register_lowering(torch.ops.tandem.onednn_linear.default, type_promotion_kind=None)
    def _lowered(x, packed, bias, out_features):
        if x.get_dtype() == torch.float32:
            return opaque(x, packed, bias, out_features)
        return direct(x, packed, bias, "none", [], "")


class PackedLinear(torch.nn.Module):
    """y = x W^T + b with W held in oneDNN's layout; inference only (no gradient flows to W)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight_bytes = weight.numel() * weight.element_size()
        # bf16 on an AVX-512 CPU without AMX: tandem's own product, which keeps up at a few rows where oneDNN's does not
        self.tiled = bf16_linear.fits(weight)
        if not self.tiled and not supported(weight.dtype):
            raise ValueError(f"a [{self.out_features} x {self.in_features}] {weight.dtype} layer: oneDNN does not pack "
                             f"{weight.dtype} here and tandem's bf16 kernel does not take it")
        self.packed = (bf16_linear.pack(weight) if self.tiled
                       else torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None))
        self.bias = None if bias is None else bias.detach()
        fixed_size(self.packed, self.bias)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> PackedLinear:
        return cls(linear.weight, linear.bias)

    def first_rows(self, rows: int) -> PackedLinear:
        """The projection onto the first `rows` outputs only (a drafter scoring part of the vocabulary)."""
        bias = None if self.bias is None else self.bias[:rows]
        return PackedLinear(self.dense_weight()[:rows], bias)

    def dense_weight(self) -> torch.Tensor:
        """The [out, in] weight, unpacked."""
        return bf16_linear.unpack(self.packed) if self.tiled else self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiled:
            return bf16_linear.bf16_linear(x, self.packed, self.bias)
        if torch.compiler.is_compiling():
            return onednn_linear(x, self.packed, self.bias, self.out_features)
        return _product(x, self.packed, self.bias, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@functools.cache
def supported(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this CPU and torch build can pack weights of `dtype`: asked of oneDNN itself, once per dtype (the
    instruction sets it needs are its business, and differ between its versions)."""
    if dtype not in PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), None)
    except RuntimeError:
        return False
    return True


def holds(out_features: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a PackedLinear can hold a layer of `out_features` outputs: oneDNN packs its dtype here, or tandem's bf16
    kernel takes it (bf16 on an AVX2 CPU, where oneDNN packs float32 alone)."""
    return supported(dtype) or bf16_linear.fits_layer(out_features, dtype, device)


def packable(model: torch.nn.Module) -> bool:
    """Whether prepack would change this model: on CPU, in a dtype oneDNN packs here or tandem's bf16 kernel runs
    in, and not a tensor-parallel shard (those linears are wrapped by the parallel plan and must stay as they are)."""
    parameter = next(model.parameters())
    sharded = torch.distributed.is_available() and torch.distributed.is_initialized()
    return (parameter.device.type == "cpu" and not sharded
            and (supported(parameter.dtype) or bf16_linear.fits_layer(bf16_linear.PANEL, parameter.dtype,
                                                                      parameter.device)))


def prepack(model: torch.nn.Module, fuse_siblings: bool = True) -> int:
    """Replace the model's nn.Linear layers (those of at least MIN_PACKED_WEIGHTS weights, and that `holds` takes) by
    PackedLinear in place, and, with `fuse_siblings`, those that read one input (q/k/v, gate/up) by parts of one
    packed product (core.fused_linear); the number of nn.Linear replaced (0 when not packable, or when already
    packed, so calling it twice is harmless)."""
    from tandem.core.fused_linear import fuse  # it builds on PackedLinear

    if not packable(model):
        return 0
    parameter = next(model.parameters())
    least = MIN_PACKED_WEIGHTS[parameter.dtype]

    def takes(out_features: int) -> bool:
        return holds(out_features, parameter.dtype, parameter.device)

    fused = fuse(model, least, takes=takes) if fuse_siblings else 0
    return fused + replace_linears(model, PackedLinear.from_linear, least, takes)


def replace_linears(model: torch.nn.Module, make, least: int = 0,
                    takes: Callable[[int], bool] | None = None) -> int:
    """Replace every nn.Linear of the model holding at least `least` weights (and whose output count `takes` accepts)
    by `make(linear)`, in place; the number replaced. The layers built here (PackedLinear, core.int8_linear's and
    core.w8a8_linear's) each keep their own copy of the weight, so a head tied to the input embedding gets its own
    and the embedding keeps its weight."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is torch.nn.Linear and child.weight.numel() >= least
             and (takes is None or takes(child.out_features))]
    mapped = MappedWeights(model)
    with torch.no_grad():
        for parent, name, child in swaps:
            setattr(parent, name, make(child))
            mapped.dropped(child)  # its layer holds a copy: the checkpoint's pages it was read from can go
    return len(swaps)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of linear-layer weights one forward reads, packed, int8 (core.int8_linear) or plain: what a decode step
    streams from memory (the embedding lookup reads a row per token, the norms are small). A layer that says its own
    `weight_bytes` is counted as it says, whatever layers it holds (core.w4_linear's holds the w8a8 one that its
    wider steps read), and a layer several modules share (a fused product's parts) once."""
    seen: set[int] = set()

    def read(module: torch.nn.Module) -> int:
        if id(module) in seen:
            return 0
        seen.add(id(module))
        if hasattr(module, "weight_bytes"):  # PackedLinear, Int8Linear, W8A8Linear, W4Linear
            return module.weight_bytes
        if isinstance(module, torch.nn.Linear):
            return module.weight.numel() * module.weight.element_size()
        return sum(read(child) for child in module.children())

    return read(model)
