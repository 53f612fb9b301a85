"""Device and dtype selection: CUDA when present, bf16 on CPUs with native bf16 support, else float32."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from tandem.errors import InvalidArgument

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float32": torch.float32, "fp32": torch.float32, "float64": torch.float64}


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """True when the CPU has AVX512-BF16 or AMX, where bf16 matmuls beat float32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def select_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise InvalidArgument(f"device: unknown device {name!r} (use auto, cpu, cuda or cuda:N)") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgument(f"device: {name!r} requested but CUDA is not available on this machine")
    return device


def select_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    if name not in DTYPES:
        raise InvalidArgument(f"dtype: unknown dtype {name!r} (use auto, {', '.join(sorted(DTYPES))})")
    return DTYPES[name]
