"""One row times a weight as one Triton kernel, the norm in front of it folded in, for batch-1 steps on a GPU.

Why: on an H200 a batch-1 decode step's small products ran far from the memory's rate under cuBLAS: the o product
6.0 µs a layer for 4.7 MB (0.8 TB/s), q/k/v 5.4 µs for 6.3 MB (1.2 TB/s), where inductor's own one-row reductions
(under coordinate-descent tuning, which slowed compiles too much to keep) took the o product in 3.1 µs; and each
RMSNorm in front of a product was a kernel of its own, two a layer at about 1.8 µs each (docs/performance.md, "On a
GPU"). Here each program takes BLOCK_N output columns and walks the whole row in tiles of BLOCK_K, so the weight is
read once by many programs at a time; with a norm folded in, every program first sums the row's squares itself (a
few kilobytes, read again from cache) and scales the row as Hugging Face's RMSNorm does, rounding where it rounds.

core.fused_linear decides where it runs (StackedLinear, ROW_PRODUCTS); the tests run the kernel under Triton's
interpreter on a CPU and build it for sm_90 (tests/test_triton_gemv_build.py). Which tile sizes are fastest on a
GPU is what `tandem.bench.row_products` measures; `launch_settings` picks by the shape until that is known.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

SMS = 132  # an H100's or H200's multiprocessors: the programs a launch should at least fill twice
TILE = 4096  # weight elements a program reads per step of its loop, at most
TUNED: dict[tuple[int, int], tuple[int, int, int]] = {}  # (N, K): (BLOCK_N, BLOCK_K, warps) measured best


@triton.jit
def _gemv(X, W, BIAS, NORM, RES, Y, sw, K: tl.constexpr, N: tl.constexpr, EPS: tl.constexpr,
          HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, GATED: tl.constexpr, HAS_RES: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Y[n] = sum_k W[n, k] x[k] (+ BIAS[n]) (+ RES[n]) for this program's BLOCK_N columns n, where x is X, or with
    HAS_NORM NORM * (X / rms(X)), or with GATED silu(X[:K]) * X[K:]; each rounded to X's dtype where Hugging Face's
    modules round (the norm's row before its gain, the activation before the product, the product before the
    residual). The loops are unrolled (K is a compile-time size), so every tile's load can be in flight at once."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    if HAS_NORM:
        squares = tl.zeros((BLOCK_K,), tl.float32)
        for start in tl.static_range(0, K, BLOCK_K):
            k = start + tl.arange(0, BLOCK_K)
            x = tl.load(X + k, mask=k < K, other=0.0).to(tl.float32)
            squares += x * x
        inverse = tl.rsqrt(tl.sum(squares, 0) / K + EPS)
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for start in tl.static_range(0, K, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(X + k, mask=k_ok, other=0.0)
        if HAS_NORM:
            normed = (x.to(tl.float32) * inverse).to(x.dtype)
            gain = tl.load(NORM + k, mask=k_ok, other=0.0)
            x = (gain.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
        if GATED:
            gate = x.to(tl.float32)
            up = tl.load(X + K + k, mask=k_ok, other=0.0)
            x = ((gate / (1.0 + tl.exp(-gate))).to(up.dtype).to(tl.float32) * up.to(tl.float32)).to(up.dtype)
        w = tl.load(W + n[:, None] * sw + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    out = tl.sum(acc, 1)
    if HAS_BIAS:
        out += tl.load(BIAS + n, mask=n_ok, other=0.0).to(tl.float32)
    if HAS_RES:
        res = tl.load(RES + n, mask=n_ok, other=0.0)
        out = out.to(res.dtype).to(tl.float32) + res.to(tl.float32)
    tl.store(Y + n, out.to(Y.dtype.element_ty), mask=n_ok)


def launch_settings(n: int, k: int, eps: float = 0.0, bias: bool = False, norm: bool = False, gated: bool = False,
                    residual: bool = False) -> dict:
    """The kernel's compile-time arguments and warps for an N x K weight: TUNED's where measured, else tiles of up
    to 512 of K, and columns per program so that the launch fills every multiprocessor about twice, from 4 up to a
    tile of TILE elements (the accumulator is a tile of float32: 32 registers a thread at 4 warps)."""
    block_n, block_k, warps = TUNED.get((n, k), (0, min(512, triton.next_power_of_2(k)), 4))
    if not block_n:
        block_n = max(4, min(TILE // block_k, 1 << max(0, (n // (2 * SMS)).bit_length() - 1)))
    return {"K": k, "N": n, "EPS": float(eps), "HAS_BIAS": bias, "HAS_NORM": norm, "GATED": gated,
            "HAS_RES": residual, "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": warps}


@triton_op("tandem::gemv", mutates_args=())
def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm: torch.Tensor | None,
         residual: torch.Tensor | None, eps: float, gated: bool) -> torch.Tensor:
    """x [K] (contiguous; [2K] with `gated`: silu of its first half times its second) times weight [N, K] (rows
    contiguous), + bias [N], + residual [N]; with `norm` [K], x is first RMSNorm-ed with that gain and `eps`.
    Returns [N] in x's dtype."""
    n, k = weight.shape
    out = x.new_empty(n)
    settings = launch_settings(n, k, eps, bias is not None, norm is not None, gated, residual is not None)
    grid = (triton.cdiv(n, settings["BLOCK_N"]),)
    # Absent tensors are passed as x: the kernel never reads them (HAS_BIAS, HAS_NORM, HAS_RES are compile-time).
    wrap_triton(_gemv)[grid](x, weight, x if bias is None else bias, x if norm is None else norm,
                             x if residual is None else residual, out, weight.stride(0), **settings)
    return out


def _flat(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    return flat if flat.is_contiguous() else flat.contiguous()


def row_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                norm: torch.Tensor | None = None, eps: float = 0.0, residual: torch.Tensor | None = None,
                gated: bool = False) -> torch.Tensor:
    """F.linear(x, weight, bias) (+ residual) for an x of one row ([..., K], every leading size 1), with `norm` and
    `eps` an RMSNorm applied to x first, or with `gated` x [..., 2K] taken as silu(x[..., :K]) * x[..., K:]; the
    result keeps x's leading sizes."""
    return gemv(_flat(x), weight, bias, norm, None if residual is None else _flat(residual), eps, gated).view(
        *x.shape[:-1], weight.shape[0])
