"""Decode attention as one Triton kernel over splits of the keys, for the compiled forwards on a GPU.

Why: on an H200 one attention call of a batch-1 decode step took 16.5 µs a layer (cuDNN's flash kernel and
flex_attention alike) for half a megabyte of keys and values: a quarter of the forward's kernel time
(docs/performance.md, "On a GPU"). That is what kernels that give one thread block a (row, head) pair and walk its
keys one tile after another would show (an inference from the times; no counters were read). Here each block takes
one (row, key/value head) pair and one split of `SPLIT` keys, for all the query heads that share that key/value head
(GQA) and all the row's queries at once, so the walk is at most SPLIT // BLOCK_N tiles; the splits' partial results
are then merged by their softmax statistics (as flash-decoding does) in a second, small kernel that also writes the
rows in the layout the attention's caller wants. (The merge ran as torch ops that inductor fused into two
reductions, 3.2 µs a layer on an H200, which gave back most of what the kernel saved over cuDNN's.)

With a split of 0 (`whole_attention`) one block walks all of a row's keys and writes the normalised output itself,
nothing merged: one kernel a layer instead of two, at the cost of a long walk where the cache is long. Whether that
beats several blocks and a merge at the lengths served is the GPU probe's question (it times splits of 0 and 64 to
1024 keys); SPLIT stays 128 until then.

The keys a query sees are a prefix of the buffer: [0, limit] for that query's limit. The runner's static forwards
build such masks (core.cuda_graphs: each row's cached length plus the query's column), and `limits` reads them back
as the count of allowed keys. Used only where core.attention says (TANDEM_GPU_ATTENTION=triton), on a GPU, inside
compiled forwards; the tests run the kernel under Triton's interpreter on a CPU where Triton is installed, and
build it for sm_90 (tests/test_triton_builds.py), since the interpreter does not check Triton's types.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from tandem.core.cuda_graphs import MAX_WIDTH  # the widest static forward

BLOCK_N = 64  # keys per tile
SPLIT = 128  # keys per split: one thread block's share of a row's keys


@triton.jit
def _split_attention(Q, K, V, LIMITS, REACH, ACC, MAX, SUM, OUT, scale, width, queries,
                     sq_r, sq_h, sq_w, sk_r, sk_h, sk_l, sv_r, sv_h, sv_l, so_r, so_w, so_h,
                     KV_HEADS: tl.constexpr, GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     SPLIT: tl.constexpr, D: tl.constexpr, PRECISION: tl.constexpr, WHOLE: tl.constexpr):
    """One (row, key/value head) pair's queries (`queries` = GROUPS x width of them, query head kv x GROUPS + g and
    column j as row g x width + j) over one split of the keys: the unnormalised output, the running max and the sum
    of exponentials, for the merge. With WHOLE the one split holds every key: the output itself, normalised, goes
    to OUT ([rows, width, heads, dim] at its strides, as the merge writes it), and ACC, MAX and SUM are unused."""
    pair, split = tl.program_id(0), tl.program_id(1)
    splits = tl.num_programs(1)
    row, kv = pair // KV_HEADS, pair % KV_HEADS
    i = tl.arange(0, BLOCK_M)
    valid = i < queries
    head = kv * GROUPS + i // width
    column = i % width
    d = tl.arange(0, D)
    q = tl.load(Q + row * sq_r + head[:, None] * sq_h + column[:, None] * sq_w + d[None, :], mask=valid[:, None],
                other=0.0)
    limit = tl.load(LIMITS + row * width + column, mask=valid, other=-1)
    end = tl.load(REACH + row)
    if not WHOLE:
        end = tl.minimum(split * SPLIT + SPLIT, end)
    top = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    for start in range(0, end - split * SPLIT, BLOCK_N):  # up to the row's reach: a split past it walks nothing
        n = split * SPLIT + start + tl.arange(0, BLOCK_N)
        inside = n < end
        k = tl.load(K + row * sk_r + kv * sk_h + n[:, None] * sk_l + d[None, :], mask=inside[:, None], other=0.0)
        # the values' load is issued with the keys', before the scores need them: a split walks one or two tiles, so
        # the two loads' latencies, overlapped, are most of its time
        v = tl.load(V + row * sv_r + kv * sv_h + n[:, None] * sv_l + d[None, :], mask=inside[:, None], other=0.0)
        # scale arrives as float64 where inductor launches the kernel: kept, it would make `top` change type
        scores = (tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale).to(tl.float32)
        scores = tl.where((n[None, :] <= limit[:, None]) & inside[None, :], scores, float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, 1))
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)  # a query that has seen no key yet stays at 0
        p = tl.exp(scores - shift[:, None])
        alpha = tl.exp(top - shift)
        total = total * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        top = new_top
    if WHOLE:  # as the merge of one split: a query that saw no key gets zeros
        out = acc / tl.maximum(total, 1e-30)[:, None]
        tl.store(OUT + row * so_r + column[:, None] * so_w + head[:, None] * so_h + d[None, :],
                 out.to(OUT.dtype.element_ty), mask=valid[:, None])
    else:
        slot = (pair * splits + split) * queries + i
        tl.store(ACC + slot[:, None] * D + d[None, :], acc, mask=valid[:, None])
        tl.store(MAX + slot, top, mask=valid)
        tl.store(SUM + slot, total, mask=valid)


@triton.jit
def _merge(ACC, MAX, SUM, OUT, width, queries, splits, so_r, so_w, so_h,
           KV_HEADS: tl.constexpr, GROUPS: tl.constexpr, D: tl.constexpr):
    """One query's splits merged by their softmax statistics, online over the splits (their count follows the
    cache's capacity, so it is no compile-time size): each split's sums rescaled to the largest max so far, a split
    that saw no key weighing 0 and a query that saw none getting zeros. Written as the query's output row in OUT's
    dtype, at OUT's strides ([rows, width, heads, dim], the layout the attention's caller wants)."""
    pair, i = tl.program_id(0), tl.program_id(1)
    row, kv = pair // KV_HEADS, pair % KV_HEADS
    d = tl.arange(0, D)
    best = tl.full((1,), -1e30, tl.float32)  # not -inf: a split with no key (max -inf) then weighs exp(-inf) = 0
    total = tl.zeros((1,), tl.float32)
    out = tl.zeros((D,), tl.float32)
    for s in range(0, splits):
        slot = (pair * splits + s) * queries + i
        top = tl.load(MAX + slot + tl.zeros((1,), tl.int32))
        new_best = tl.maximum(best, top)
        keep, weight = tl.exp(best - new_best), tl.exp(top - new_best)
        total = total * keep + tl.load(SUM + slot + tl.zeros((1,), tl.int32)) * weight
        out = out * keep + tl.load(ACC + slot * D + d) * weight
        best = new_best
    out = out / tl.maximum(total, 1e-30)
    head, column = kv * GROUPS + i // width, i % width
    tl.store(OUT + row * so_r + column * so_w + head * so_h + d, out.to(OUT.dtype.element_ty))


@triton_op("tandem::merge_splits", mutates_args=())
def merge_splits(acc: torch.Tensor, top: torch.Tensor, total: torch.Tensor, heads: int, width: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """split_attention's partial results merged: [rows, width, heads, dim] in `dtype`, one kernel."""
    rows, kv_heads, splits, queries, dim = acc.shape
    out = acc.new_empty((rows, width, heads, dim), dtype=dtype)
    wrap_triton(_merge)[(rows * kv_heads, queries)](
        acc, top, total, out, width, queries, splits, out.stride(0), out.stride(1), out.stride(2),
        KV_HEADS=kv_heads, GROUPS=heads // kv_heads, D=dim, num_warps=1)
    return out


@triton_op("tandem::split_attention", mutates_args=())
def split_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, limits: torch.Tensor,
                    reach: torch.Tensor, scale: float, split: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per split of `split` keys: the unnormalised outputs [rows, kv_heads, splits, groups x width, dim] (float32),
    their max scores and sums of exponentials [rows, kv_heads, splits, groups x width]. limits [rows, width] (int32):
    the last key each query sees; reach [rows] (int32): one past a row's furthest key."""
    rows, heads, width, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    splits = triton.cdiv(length, split)
    queries = groups * width
    acc = query.new_empty((rows, kv_heads, splits, queries, dim), dtype=torch.float32)
    top = query.new_empty((rows, kv_heads, splits, queries), dtype=torch.float32)
    total = torch.empty_like(top)
    wrap_triton(_split_attention)[(rows * kv_heads, splits)](
        query, key, value, limits, reach, acc, top, total, acc, scale, width, queries,
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), 0, 0, 0,
        **launch_settings(kv_heads, groups, width, dim, query.dtype, split))
    return acc, top, total


@triton_op("tandem::whole_attention", mutates_args=())
def whole_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, limits: torch.Tensor,
                    reach: torch.Tensor, scale: float) -> torch.Tensor:
    """split_attention where one split holds every key: [rows, width, heads, dim] in the query's dtype, normalised,
    in one kernel (no merge)."""
    rows, heads, width, dim = query.shape
    kv_heads = key.shape[1]
    out = query.new_empty((rows, width, heads, dim))
    # The walk runs to the row's reach, a runtime value, so no size here depends on the buffer's length.
    settings = launch_settings(kv_heads, heads // kv_heads, width, dim, query.dtype) | {"WHOLE": True}
    wrap_triton(_split_attention)[(rows * kv_heads, 1)](
        query, key, value, limits, reach, out, out, out, out, scale, width, heads // kv_heads * width,
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), out.stride(0), out.stride(1), out.stride(2), **settings)
    return out


def launch_settings(kv_heads: int, groups: int, width: int, dim: int, dtype: torch.dtype,
                    split: int = SPLIT) -> dict:
    """The kernel's compile-time arguments and warps for a call: one block holds all the queries of a (row, key/value
    head) pair, for a width up to MAX_WIDTH where the forward is wider than one token, over `split` keys (a multiple
    of BLOCK_N)."""
    block_m = max(16, triton.next_power_of_2(groups * (1 if width == 1 else MAX_WIDTH)))
    return {"KV_HEADS": kv_heads, "GROUPS": groups, "BLOCK_M": block_m, "BLOCK_N": BLOCK_N, "SPLIT": split, "D": dim,
            "PRECISION": "ieee" if dtype == torch.float32 else "tf32", "WHOLE": False,
            "num_warps": 4 if block_m <= 32 else 8}


def split_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                 scale: float | None = None, split: int = SPLIT) -> torch.Tensor:
    """query [rows, heads, width, dim]; key and value [rows, kv_heads, length, dim] (last dimension contiguous),
    query head h reading key/value head h // (heads // kv_heads); mask [rows, 1, width, length] booleans, each
    query's a prefix of the keys, or None (every key); `split` keys per thread block (a multiple of BLOCK_N), or 0:
    each row's keys walked by one block, whatever their number, and nothing merged (a choice made by the caller,
    never by the buffer's length, which the compiled forwards hold symbolic and guard-free: core.guardless). Returns
    [rows, heads, width, dim] in the query's dtype."""
    rows, heads, width, dim = query.shape
    length = key.shape[2]
    if mask is None:
        limits = torch.full((rows, width), length - 1, dtype=torch.int32, device=query.device)
    else:
        limits = (mask[:, 0].sum(-1) - 1).to(torch.int32)
    reach = (limits.amax(-1) + 1).to(torch.int32)
    key = key.contiguous() if key.stride(-1) != 1 else key
    value = value.contiguous() if value.stride(-1) != 1 else value
    scale = dim**-0.5 if scale is None else scale
    if not split:  # one thread block a (row, key/value head) pair walks every key: nothing to merge
        return whole_attention(query, key, value, limits.contiguous(), reach, scale).transpose(1, 2)
    acc, top, total = split_attention(query, key, value, limits.contiguous(), reach, scale, split)
    # One kernel merges the splits and lays the rows out as [rows, width, heads, dim], which the caller's transpose
    # back and .contiguous() then leave as they are. A query that sees no key at all (none does in the runner's
    # masks) gets zeros rather than sdpa's NaN.
    return merge_splits(acc, top, total, heads, width, query.dtype).transpose(1, 2)
