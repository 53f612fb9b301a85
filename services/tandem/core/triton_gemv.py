"""One row times a weight as one Triton kernel, the norm in front of it folded in, for batch-1 steps on a GPU.

Why: on an H200 a batch-1 decode step's small products ran far from the memory's rate under cuBLAS: the o product
6.0 µs a layer for 4.7 MB (0.8 TB/s), q/k/v 5.4 µs for 6.3 MB (1.2 TB/s), where inductor's own one-row reductions
(under coordinate-descent tuning, which slowed compiles too much to keep) took the o product in 3.1 µs; and each
RMSNorm in front of a product was a kernel of its own, two a layer at about 1.8 µs each (docs/performance.md, "On a
GPU"). Here each program takes BLOCK_N output columns and walks the whole row in tiles of BLOCK_K, so the weight is
read once by many programs at a time; with a norm folded in, every program first sums the row's squares itself (a
few kilobytes, read again from cache) and scales the row as Hugging Face's RMSNorm does, rounding where it rounds.
A folded attention's q/k/v also rotates q and k by the position's rotary embedding as it writes them (the kernels
that rotated them, one or two a layer, are gone): a program then takes columns j and j + head/2 of its heads, the
two that each rotation mixes.

core.fused_linear decides where it runs (StackedLinear, ROW_PRODUCTS); the tests run the kernel under Triton's
interpreter on a CPU and build it for sm_90 (tests/test_triton_builds.py). Which tile sizes are fastest on a
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
def _to_cache(KC, VC, c, value, ok, slot, pos, sc_s, sc_h, sc_l, QUERY: tl.constexpr, ROPE: tl.constexpr,
              HEAD: tl.constexpr):
    """Columns c of q/k/v's output: k's (QUERY <= c < ROPE) into the key buffer, v's (c >= ROPE) into the value
    buffer, each at [slot, its head, pos]; q's nowhere."""
    is_v = c >= ROPE
    j = tl.maximum(tl.where(is_v, c - ROPE, c - QUERY), 0)
    where = slot * sc_s + (j // HEAD) * sc_h + pos * sc_l + j % HEAD
    value = value.to(KC.dtype.element_ty)
    tl.store(KC + where, value, mask=ok & (c >= QUERY) & ~is_v)
    tl.store(VC + where, value, mask=ok & is_v)


@triton.jit
def _gemv(X, W, BIAS, NORM, RES, COS, SIN, Y, KC, VC, SLOT, POS, sw, sc_s, sc_h, sc_l, K: tl.constexpr,
          N: tl.constexpr, EPS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, GATED: tl.constexpr,
          HAS_RES: tl.constexpr, ROPE: tl.constexpr, HEAD: tl.constexpr, TO_CACHE: tl.constexpr,
          QUERY: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Y[n] = sum_k W[n, k] x[k] (+ BIAS[n]) (+ RES[n]) for this program's BLOCK_N columns n, where x is X, or with
    HAS_NORM NORM * (X / rms(X)), or with GATED silu(X[:K]) * X[K:]; each rounded to X's dtype where Hugging Face's
    modules round (the norm's row before its gain, the activation before the product, the product before the
    residual). The loops are unrolled (K is a compile-time size), so every tile's load can be in flight at once.

    With ROPE (the first ROPE columns are heads of HEAD, q's and k's), the rotary embedding is applied to those
    columns as Hugging Face's apply_rotary_pos_emb does (y = x cos + rotate_half(x) sin, each product rounded): a
    program then takes BLOCK_N column pairs, column j of a head with column j + HEAD / 2, whose rotation mixes just
    the two, and past the rotated columns two runs of BLOCK_N columns (v's), left as they are. With TO_CACHE (the
    first QUERY columns q's), k's and v's columns also go into the layer's key and value buffers KC and VC at the
    slot and position SLOT and POS hold, where the cache's own write would have put them."""
    i = tl.arange(0, BLOCK_N)
    if ROPE:
        first = tl.program_id(0) * BLOCK_N  # in pairs of columns: ROPE // 2 rotated pairs, then v's in twos
        rotated = first < ROPE // 2
        pair = first + i
        lead = (pair // (HEAD // 2)) * HEAD + pair % (HEAD // 2)
        flat = ROPE + (first - ROPE // 2) * 2 + i
        n = tl.where(rotated, lead, flat)
        n2 = tl.where(rotated, lead + HEAD // 2, flat + BLOCK_N)
        n2_ok = n2 < N
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    else:
        n = tl.program_id(0) * BLOCK_N + i
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
        if ROPE:
            w2 = tl.load(W + n2[:, None] * sw + k[None, :], mask=n2_ok[:, None] & k_ok[None, :], other=0.0)
            acc2 += w2.to(tl.float32) * x.to(tl.float32)[None, :]
    out = tl.sum(acc, 1)
    if HAS_BIAS:
        out += tl.load(BIAS + n, mask=n_ok, other=0.0).to(tl.float32)
    if HAS_RES:
        res = tl.load(RES + n, mask=n_ok, other=0.0)
        out = out.to(res.dtype).to(tl.float32) + res.to(tl.float32)
    if ROPE:
        out2 = tl.sum(acc2, 1)
        if HAS_BIAS:
            out2 += tl.load(BIAS + n2, mask=n2_ok, other=0.0).to(tl.float32)
        dtype = Y.dtype.element_ty
        a, b = out.to(dtype).to(tl.float32), out2.to(dtype).to(tl.float32)  # the product, as F.linear returns it
        j = pair % (HEAD // 2)
        cos_a = tl.load(COS + j).to(tl.float32)
        sin_a = tl.load(SIN + j).to(tl.float32)
        cos_b = tl.load(COS + j + HEAD // 2).to(tl.float32)
        sin_b = tl.load(SIN + j + HEAD // 2).to(tl.float32)
        turned_a = (a * cos_a).to(dtype).to(tl.float32) + (-b * sin_a).to(dtype).to(tl.float32)
        turned_b = (b * cos_b).to(dtype).to(tl.float32) + (a * sin_b).to(dtype).to(tl.float32)
        out = tl.where(rotated, turned_a, out)
        out2 = tl.where(rotated, turned_b, out2).to(dtype)
        tl.store(Y + n2, out2, mask=n2_ok)
        if TO_CACHE:
            slot, pos = tl.load(SLOT), tl.load(POS)
            _to_cache(KC, VC, n, out.to(dtype), n_ok, slot, pos, sc_s, sc_h, sc_l, QUERY, ROPE, HEAD)
            _to_cache(KC, VC, n2, out2, n2_ok, slot, pos, sc_s, sc_h, sc_l, QUERY, ROPE, HEAD)
    tl.store(Y + n, out.to(Y.dtype.element_ty), mask=n_ok)


def launch_settings(n: int, k: int, eps: float = 0.0, bias: bool = False, norm: bool = False, gated: bool = False,
                    residual: bool = False, rope: int = 0, head: int = 0) -> dict:
    """The kernel's compile-time arguments and warps for an N x K weight: TUNED's where measured, else tiles of up
    to 512 of K, and columns per program so that the launch fills every multiprocessor about twice, from 4 up to a
    tile of TILE elements (the accumulator is a tile of float32: 32 registers a thread at 4 warps). With `rope`
    rotated columns in heads of `head`, a program takes BLOCK_N column pairs: BLOCK_N then divides half a head and
    the unrotated columns come in whole pairs of runs."""
    block_n, block_k, warps = TUNED.get((n, k), (0, min(512, triton.next_power_of_2(k)), 4))
    if not block_n:
        block_n = max(4, min(TILE // block_k, 1 << max(0, (n // (2 * SMS)).bit_length() - 1)))
    if rope:
        block_n = min(block_n, head // 2)
        while (head // 2) % block_n or (n - rope) % (2 * block_n):
            block_n //= 2
    return {"K": k, "N": n, "EPS": float(eps), "HAS_BIAS": bias, "HAS_NORM": norm, "GATED": gated,
            "HAS_RES": residual, "ROPE": rope, "HEAD": head, "TO_CACHE": False, "QUERY": 0, "BLOCK_N": block_n,
            "BLOCK_K": block_k, "num_warps": warps}


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm: torch.Tensor | None,
            residual: torch.Tensor | None, eps: float, gated: bool, cos: torch.Tensor | None,
            sin: torch.Tensor | None, rope: int, head: int,
            cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor:
    n, k = weight.shape
    out = x.new_empty(n)
    settings = launch_settings(n, k, eps, bias is not None, norm is not None, gated, residual is not None, rope, head)
    columns = settings["BLOCK_N"] * (2 if rope else 1)  # a rotating program takes pairs
    keys, values, slot, position, query = cache if cache is not None else (x, x, x, x, 0)
    strides = keys.stride()[:3] if cache is not None else (0, 0, 0)
    # Absent tensors are passed as x: the kernel never reads them (HAS_BIAS, HAS_NORM, HAS_RES, ROPE, TO_CACHE are
    # compile-time).
    wrap_triton(_gemv)[(triton.cdiv(n, columns),)](
        x, weight, x if bias is None else bias, x if norm is None else norm, x if residual is None else residual,
        x if cos is None else cos, x if sin is None else sin, out, keys, values, slot, position, weight.stride(0),
        *strides, **settings | {"TO_CACHE": cache is not None, "QUERY": query})
    return out


@triton_op("tandem::gemv", mutates_args=())
def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm: torch.Tensor | None,
         residual: torch.Tensor | None, eps: float, gated: bool, cos: torch.Tensor | None = None,
         sin: torch.Tensor | None = None, rope: int = 0, head: int = 0) -> torch.Tensor:
    """x [K] (contiguous; [2K] with `gated`: silu of its first half times its second) times weight [N, K] (rows
    contiguous), + bias [N], + residual [N]; with `norm` [K], x is first RMSNorm-ed with that gain and `eps`; with
    `rope`, the first `rope` columns (heads of `head`) rotated by `cos` and `sin` [head] as Hugging Face rotates q
    and k. Returns [N] in x's dtype."""
    return _launch(x, weight, bias, norm, residual, eps, gated, cos, sin, rope, head)


@triton_op("tandem::gemv_to_cache", mutates_args=("keys", "values"))
def gemv_to_cache(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm: torch.Tensor | None,
                  eps: float, cos: torch.Tensor, sin: torch.Tensor, rope: int, head: int, query: int,
                  keys: torch.Tensor, values: torch.Tensor, slot: torch.Tensor, position: torch.Tensor
                  ) -> torch.Tensor:
    """gemv for a folded attention's q/k/v (the first `query` columns q's, then k's up to `rope`, then v's) that
    also writes k's and v's columns into one layer's buffers [slots, kv heads, positions, head], at the slot and
    position the one-element tensors `slot` and `position` hold: the cache's write, in the product's kernel."""
    return _launch(x, weight, bias, norm, None, eps, False, cos, sin, rope, head,
                   (keys, values, slot, position, query))


def _flat(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    return flat if flat.is_contiguous() else flat.contiguous()


def row_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                norm: torch.Tensor | None = None, eps: float = 0.0, residual: torch.Tensor | None = None,
                gated: bool = False, rope: tuple[torch.Tensor, torch.Tensor, int, int] | None = None,
                cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None
                ) -> torch.Tensor:
    """F.linear(x, weight, bias) (+ residual) for an x of one row ([..., K], every leading size 1), with `norm` and
    `eps` an RMSNorm applied to x first, or with `gated` x [..., 2K] taken as silu(x[..., :K]) * x[..., K:]; with
    `rope` (cos, sin, columns, head dim; cos and sin that row's [..., head dim]) the first columns rotated, and with
    `cache` (keys, values, slot, position, q's columns) k's and v's written into the buffers (gemv_to_cache); the
    result keeps x's leading sizes."""
    cos, sin, columns, head = rope if rope is not None else (None, None, 0, 0)
    cos, sin = (None if t is None else _flat(t) for t in (cos, sin))
    if cache is not None:
        out = gemv_to_cache(_flat(x), weight, bias, norm, eps, cos, sin, columns, head, cache[4], *cache[:4])
    else:
        out = gemv(_flat(x), weight, bias, norm, None if residual is None else _flat(residual), eps, gated, cos, sin,
                   columns, head)
    return out.view(*x.shape[:-1], weight.shape[0])
