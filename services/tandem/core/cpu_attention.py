"""Decode attention on an AVX-512 CPU: a kernel of tandem's own (csrc/decode_attention.cpp) for the few queries a
decode or verification step puts on each row, over that row's cached keys.

Why not PyTorch's: its CPU flash kernel splits the work into (row, head, query block) tasks and pays about 10-17 us of
set-up per task; over 8 rows of the 1.5B target that is 440-520 us a layer, 3.5-4x the time its keys and values
take to read (docs/performance.md, "Against vLLM for CPU"), and what 8 rows add to a plain step. An
inductor-compiled reduction, two matmuls and compiled flex_attention were each slower still. The kernel reads each
row's keys and values once for all the query heads that share them, skips keys past the last one any query sees,
and keeps its sums in float32.

`decode_attention` is the op `tandem::decode_attention` (its schema and shape function here, its CPU kernel
registered by the built library), so compiled forwards call it as they are traced. `ready()` builds the library once
per machine (about 30 s, under the model store's `kernels/`, with the compiler torch.compile already needs, and
ninja) and says whether the kernel can run here: an AVX-512 CPU, a C++ compiler. `ENABLED[0]` turns it off (sdpa
runs as before); core.attention reads it, and compiled forwards are keyed by it (attention.traced_settings).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tandem.core import cpu_kernels

SOURCE = Path(__file__).with_name("csrc") / "decode_attention.cpp"
ENABLED: list[bool] = [os.environ.get("TANDEM_CPU_ATTENTION", "kernel") != "sdpa"]  # a cell, as attention.FLEX
# Queries per task (query heads per key/value head x tokens per row) up to which the kernel runs: decode and
# verification steps. Wider ones (prompts) keep sdpa, whose tiled products suit them.
MAX_QUERIES = 64
HEAD_DIMS = (16, 32, 64, 128, 256)
# Whether the CPU has AVX512-BF16: the kernel then computes by bf16 dot products (vdpbf16ps), half the instructions
# of float32 multiply-adds, with no widening of keys and values.
BF16_DOT = torch.cpu._is_avx512_bf16_supported()
_built: list[bool] = []  # once asked: whether the kernel was built and registered


def ready() -> bool:
    """Whether the kernel can run in this process, building it on first use."""
    if not _built:
        _built.append(_build())
    return _built[0]


def prepare(device: torch.device, dtype: torch.dtype) -> None:
    """Build the kernel now where a model on `device` in `dtype` would use it (a runner calls this as it starts)."""
    if ENABLED[0] and device.type == "cpu" and dtype == torch.bfloat16:
        ready()


def _ready_now() -> bool:
    return bool(_built) and _built[0]


def _build() -> bool:
    return cpu_kernels.build(SOURCE, "CPU decode-attention kernel")


def _build_source() -> Path:
    return cpu_kernels.build_copy(SOURCE)


def applies(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether `decode_attention` serves a stacked query [rows, kv_heads, queries, dim] over `key` (core.attention
    asks before calling it). Only once built (`prepare`, which a runner calls as it starts): a forward
    never waits for a build."""
    return (ENABLED[0] and query.device.type == "cpu" and query.dtype == key.dtype == torch.bfloat16
            and query.shape[-1] in HEAD_DIMS and query.shape[2] <= MAX_QUERIES and _ready_now())


torch.library.define("tandem::decode_attention",
                     "(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale, bool bf16_dot) -> Tensor")


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scale: float, bf16_dot: bool | None = None) -> torch.Tensor:
    """softmax(query key^T * scale) value per row and key/value head, `mask` [rows, 1, 1 or queries, length] bool
    (true: seen) or None; query [rows, kv_heads, queries, dim], key and value [rows, kv_heads, length, dim], bf16.
    The op `tandem::decode_attention`, whose CPU kernel the built library registers (`ready`). `bf16_dot`: the scores
    and the weighted values by AVX512-BF16 dot products (exact products of bf16 inputs, the softmax weights rounded
    to bf16 as sdpa rounds them, float32 sums; the default where the CPU has them, BF16_DOT) or by float32
    multiply-adds of the widened keys and values."""
    return torch.ops.tandem.decode_attention(query, key, value, mask, scale, BF16_DOT if bf16_dot is None else bf16_dot)


@torch.library.register_fake("tandem::decode_attention")
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
      scale: float, bf16_dot: bool) -> torch.Tensor:
    return query.new_empty(query.shape)
