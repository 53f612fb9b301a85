"""sdpa attention that reads grouped-query keys and values as they lie in the cache, mask or no mask.

Hugging Face's sdpa path repeats every key/value head for its query heads (repeat_kv: a copy of the keys and values
read, n_rep times over) whenever a mask is given, except, from transformers 5.23, for one query token. The runner's
batched forwards always carry a mask, and verification feeds several tokens per row, so that copy would come back
every step. Even without the copy (enable_gqa), PyTorch's CPU flash kernel takes ~10x longer over 12 heads of one
query than over 2 heads of 6 (measured: 205 against 20 us for 200 keys), which made attention an eighth of a
prepacked decode step. Here the query heads that share a key/value head are stacked along the query axis instead:
[batch, kv_heads * n_rep, width, dim] -> [batch, kv_heads, n_rep * width, dim], with the mask repeated to match
(n_rep rows of booleans, not keys). Each query row still attends over the same keys with the same weights.

The runner switches a model to this implementation only for the duration of its own forwards (`packed`), so the
model object stays plain sdpa for anything else that calls it. That switch is the model's own (its config's), so
runners over one model object (in-process canary arms share the target) run their forwards one at a time, under
the model's `forward_lock`: another runner's forward would otherwise start or end inside it (a KeyError for the
varlen call's rows, or rows attended as one).

Forwards over rows of different widths (prompts arriving together, drafts of different lengths) can instead feed
every row's tokens one after another in a single row (`packed(config, varlen=True)`, a kv_cache Step with `packed`;
core.row_layout decides): the products then run over the tokens alone, where padding every row to the widest costs
its share of the products' time. Attention is what must not mix rows, so `varlen_sdpa_forward` runs it per row over
that row's own cached keys, given the rows' places as `SEGMENTS` (passed through the model's forward to every
attention call). Transformers builds no mask for that implementation (it has no mask function), which is as wanted:
each row's mask comes with its segment.

`BACKENDS[0]`, when set, restricts which of PyTorch's sdpa kernels these forwards may use (`torch.nn.attention`'s
SDPBackend; None: PyTorch picks). On an H100 PyTorch picks cuDNN's flash kernel, which took 10.8 us a layer for one
query over a few hundred cached keys (docs/performance.md, "On a GPU"); tandem.bench.gpu_probe's `--only-attention`
times the others against it (on an H200 the pick decoded 1.11x faster than the memory-efficient kernel). Compiled
forwards read it when they are traced, and retrace when it changes.

On a CPU in bf16 the stacked call runs core.cpu_attention's kernel where it applies (decode and verification
widths), sdpa elsewhere.

`FLEX[0]`, when True, makes compiled forwards attend with core.flex_decode instead: each row's live keys only, split
across thread blocks, where sdpa walks the whole buffer under the mask (the cost that grows with the cache's
capacity on a GPU), on a GPU only (FLEX_DEVICES). `TANDEM_GPU_ATTENTION=flex` in the environment turns it on. It is
off by default: on an H200 it made one batch-1 forward 1.05x faster and passed its equality tests, but its end-to-end
gain and batch 8 are not settled (docs/performance.md, "On a GPU"). `TRITON[0]` (`TANDEM_GPU_ATTENTION=triton`)
likewise attends with core.triton_decode, one Triton kernel over splits of the keys; off by default: on an H200
its kernel took 9.8 µs a layer against cuDNN's 16.3, but with the splits' merge (two reductions then, one small
kernel since, not yet timed) one forward was no faster.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from tandem.core import cpu_attention, fused_linear
from tandem.core.flex_decode import flex_decode

NAME = "tandem_packed_sdpa"
VARLEN = "tandem_varlen_sdpa"
SEGMENTS = "tandem_segments"  # the keyword that carries a packed forward's rows to varlen_sdpa_forward
BACKENDS: list[tuple[SDPBackend, ...] | None] = [None]  # a cell: compiled code guards on its content
GPU_KERNELS = ("sdpa", "flex", "triton")
GPU_ATTENTION = os.environ.get("TANDEM_GPU_ATTENTION", "sdpa")
if GPU_ATTENTION not in GPU_KERNELS:
    raise ValueError(f"TANDEM_GPU_ATTENTION: one of {', '.join(GPU_KERNELS)}, got {GPU_ATTENTION!r}")
FLEX: list[bool] = [GPU_ATTENTION == "flex"]  # a cell, as BACKENDS
TRITON: list[bool] = [GPU_ATTENTION == "triton"]  # a cell: compiled forwards attend with core.triton_decode
# A cell: keys per thread block of core.triton_decode (None: its SPLIT; 0: a row's keys in one block, unmerged).
# Benchmarks set it (gpu_attention) until a GPU sitting settles the default.
TRITON_SPLIT: list[int | None] = [None]
# Inductor's C++ template for flex_attention (torch 2.13) fails inside a compiled decoder on a CPU (no epilogue
# fusion; a C++ compile error with two layers); GPUs run its Triton template.
FLEX_DEVICES = ("cuda",)


def traced_settings() -> tuple:
    """The cells compiled forwards read as they are traced (BACKENDS, FLEX, TRITON, TRITON_SPLIT,
    core.cpu_attention.ENABLED, core.fused_linear.ROW_PRODUCTS and KV_WRITES): a graph serves only the settings it
    was traced under, so core.cuda_graphs keys its guard-free calls by them too."""
    return (BACKENDS[0], FLEX[0], TRITON[0], TRITON_SPLIT[0], cpu_attention.ENABLED[0], fused_linear.ROW_PRODUCTS[0],
            fused_linear.KV_WRITES[0])


def packed_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        **kwargs) -> tuple[torch.Tensor, None]:
    groups = getattr(module, "num_key_value_groups", 1)
    width = query.shape[2]
    # Without a mask every query sees every key; that holds for stacked rows only when each row has one query (a
    # causal multi-token forward would become causal over the stacked rows, and is a prefill, which stays sdpa's).
    # Both the stacked call and flex_decode take a boolean [rows, 1, width, keys] mask and nothing beyond it.
    maskless_ok = attention_mask is None and width == 1
    fits = ((maskless_ok or (attention_mask is not None and attention_mask.dtype == torch.bool
                             and attention_mask.shape[1] == 1))
            and kwargs.get("position_bias") is None and kwargs.get("softcap") is None
            and not (module.training and dropout))
    if fits and (FLEX[0] or TRITON[0]) and query.device.type in FLEX_DEVICES and torch.compiler.is_compiling():
        if TRITON[0]:  # imported here: Triton is there only on a GPU machine
            from tandem.core.triton_decode import split_decode

            split = {} if TRITON_SPLIT[0] is None else {"split": TRITON_SPLIT[0]}
            return split_decode(query, key, value, attention_mask, scaling, **split).transpose(1, 2).contiguous(), None
        return flex_decode(query, key, value, attention_mask, scaling).transpose(1, 2).contiguous(), None
    if groups == 1 or not fits:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    batch, heads, width, dim = query.shape
    # Query head kv * groups + r becomes row r * width + j of key/value head kv.
    stacked = query.reshape(batch, heads // groups, groups * width, dim)
    mask = attention_mask
    if mask is not None and width > 1:
        mask = mask.unsqueeze(2).expand(-1, -1, groups, -1, -1).reshape(batch, 1, groups * width, mask.shape[-1])
    if cpu_attention.applies(stacked, key):
        out = cpu_attention.decode_attention(stacked, key, value, mask, dim**-0.5 if scaling is None else scaling)
    else:
        with sdpa_kernel(list(BACKENDS[0])) if BACKENDS[0] else nullcontext():
            out = torch.nn.functional.scaled_dot_product_attention(stacked, key, value, attn_mask=mask,
                                                                   scale=scaling)
    return out.reshape(batch, heads, width, value.shape[-1]).transpose(1, 2).contiguous(), None


def varlen_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        **kwargs) -> tuple[torch.Tensor, None]:
    """Rows packed into one: query [1, heads, tokens, dim]; key and value [rows, kv_heads, length, dim], the rows of
    the view; kwargs[SEGMENTS] (row, offset, start, count, mask) per row (kv_cache.Step.segments). Returns
    [1, tokens, heads, dim] as the other implementations do."""
    segments = kwargs.pop(SEGMENTS)
    out = [packed_sdpa_forward(module, query[:, :, offset : offset + count], key[row : row + 1, :, : start + count],
                               value[row : row + 1, :, : start + count], mask, dropout=dropout, scaling=scaling,
                               **kwargs)[0]
           for row, offset, start, count, mask in segments]
    return torch.cat(out, dim=1), None


AttentionInterface.register(NAME, packed_sdpa_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)  # masks transformers builds itself stay sdpa's
AttentionInterface.register(VARLEN, varlen_sdpa_forward)  # and no mask function: transformers builds none


@contextmanager
def gpu_attention(kernel: str, backends: tuple[SDPBackend, ...] | None = None,
                  split: int | None = None) -> Iterator[None]:
    """Inside the block, forwards traced for a GPU attend with `kernel`: "sdpa" (restricted to `backends`, None:
    PyTorch picks), "flex" or "triton" (`split` keys a thread block; None: core.triton_decode's SPLIT, 0: a row's
    keys in one block), whatever TANDEM_GPU_ATTENTION set; the cells are restored after. Benchmarks A/B the kernels
    with it."""
    saved = BACKENDS[0], FLEX[0], TRITON[0], TRITON_SPLIT[0]
    BACKENDS[0], FLEX[0], TRITON[0], TRITON_SPLIT[0] = backends, kernel == "flex", kernel == "triton", split
    try:
        yield
    finally:
        BACKENDS[0], FLEX[0], TRITON[0], TRITON_SPLIT[0] = saved


_FORWARD_LOCKS: weakref.WeakKeyDictionary[torch.nn.Module, threading.RLock] = weakref.WeakKeyDictionary()
_FORWARD_LOCKS_GUARD = threading.Lock()


def forward_lock(model: torch.nn.Module) -> threading.RLock:
    """The lock every runner over `model` holds while it runs the model (one per model object). Taken outside the
    compiled forward (dynamo does not trace locks): the runner holds it around its whole model call."""
    with _FORWARD_LOCKS_GUARD:
        lock = _FORWARD_LOCKS.get(model)
        if lock is None:
            lock = _FORWARD_LOCKS[model] = threading.RLock()
        return lock


@contextmanager
def packed(config, varlen: bool = False) -> Iterator[None]:
    """Run sdpa models through packed_sdpa_forward inside the block (with `varlen`, varlen_sdpa_forward); other
    implementations are left alone."""
    if config._attn_implementation != "sdpa":
        yield
        return
    config._attn_implementation = VARLEN if varlen else NAME
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"
