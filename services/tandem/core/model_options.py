"""How each model of a pair is held and run, as the CLI, engine options and model loader take it: its weights'
quantization, whether its decode forwards compile or run eagerly, the finished caches its runner keeps, and the
vocabulary a drafter scores.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from tandem.errors import InvalidArgument

if TYPE_CHECKING:  # the CLI reads this module on installs without torch (the client's)
    import torch

# The dtypes a model may be loaded in, by the names --dtype takes, as torch's attribute names (core.device.DTYPES).
DTYPE_NAMES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
               "float32": "float32", "fp32": "float32", "float64": "float64"}
DEVICE_NAME = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def check_device_and_dtype(device: str, dtype: str) -> None:
    """The names alone, checked where the options are given, before anything loads (core.device resolves them)."""
    if not DEVICE_NAME.match(device):
        raise InvalidArgument(f"device: unknown device {device!r} (use auto, cpu, cuda or cuda:N)")
    if dtype != "auto" and dtype not in DTYPE_NAMES:
        raise InvalidArgument(f"dtype: unknown dtype {dtype!r} (use auto, {', '.join(sorted(DTYPE_NAMES))})")


# How a draft model's linear weights are held: "int8" weights with activations in the model's dtype
# (core.int8_linear), "w8a8" int8 weights and activations quantized per row on a CPU (core.w8a8_linear), "w4" those
# w8a8 layers with an int4 copy for one-row steps (core.w4_linear); "auto" (drafts' default) is w4 where it has been
# measured to pay and its kernels run (`resolve_quantization`), else none. A target is always held as loaded: the
# draft's weights change how many drafts are accepted, never the output.
QUANTIZATIONS = ("auto", "none", "int8", "w8a8", "w4")
DEFAULT_DRAFT_QUANTIZATION = "auto"


def resolve_quantization(quantization: str, device: torch.device, dtype: torch.dtype, eager: bool) -> str:
    """The weights a draft loaded with this setting is held in: `quantization` itself unless "auto", which is "w4"
    for bf16 weights on an AVX-512 CPU whose torch runs the int4 and int8 kernels, and "none" elsewhere (a GPU, an
    eager model, float32, tensor parallelism). AVX-512 is where the w4 draft was measured faster than the bf16 one
    (AUTO at batch 1 1.34x the bf16 draft's on a 2-vCPU AVX512-BF16 Xeon, 1.21x with the bf16 draft on core.bf16_linear:
    docs/performance.md "Int4 for one-row draft steps", "A bf16 product of tandem's own"); on AVX2
    alone it is not measured, so auto leaves it off there."""
    if quantization not in QUANTIZATIONS:
        raise InvalidArgument(f"quantization: one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if quantization != "auto":
        return quantization
    import torch

    from tandem.core.device import cpu_runs_avx512
    from tandem.core.w4_linear import refusal

    if dtype != torch.bfloat16 or eager or not cpu_runs_avx512():
        return "none"
    return "w4" if refusal(device) is None else "none"


# Which models of a pair compile their decode forwards with torch.compile on a CPU (a GPU compiles both by default).
# "draft": the draft alone, whose small layers gain most from compiling (1.26x a forward against the target's 1.05x
# on a 2-core CPU, docs/performance.md), without the target's minutes of compiling. True and False, as a model's own
# setting is given, stand for "all" and "none".
COMPILE_SCOPES = ("none", "draft", "all")


def compile_scope(compile: bool | str) -> str:
    """The scope a --compile setting names (a scope, or a bool for all or none)."""
    if isinstance(compile, bool):
        return "all" if compile else "none"
    if compile not in COMPILE_SCOPES:
        raise InvalidArgument(f"compile: one of {', '.join(COMPILE_SCOPES)}, got {compile!r}")
    return compile


def compiles(compile: bool | str, draft: bool) -> bool:
    """Whether a pair's draft (`draft`) or target compiles its decode forwards under this setting."""
    scope = compile_scope(compile)
    return scope == "all" or (scope == "draft" and draft)


def check_model_mode(eager: bool, compile: bool | str) -> None:
    """How a model runs: eager (as Hugging Face builds it) and compile (torch.compile'd forwards) exclude each other."""
    if eager and compile_scope(compile) != "none":
        raise InvalidArgument("eager and compile exclude each other: compiling is part of the fast path eager skips")


# Tokens of finished sequences' caches a runner keeps (core.slots) for a session's next turn and shared prefixes.
DEFAULT_RETAIN_TOKENS = 32768


def check_retain_tokens(retain_tokens: int) -> None:
    if retain_tokens < 0:
        raise InvalidArgument(f"retain_tokens: must be non-negative (0: none kept), got {retain_tokens}")


def draft_vocab_limit(draft_vocab: int, target_vocab: int) -> int:
    """The ids the drafter scores: never beyond the target's vocabulary, fewer if `draft_vocab` asks."""
    return min(draft_vocab, target_vocab) if draft_vocab else target_vocab
