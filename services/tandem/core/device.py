"""Device and dtype selection: CUDA when present, bf16 on CPUs with native bf16 support, else float32.

A CUDA device is only handed out after a tiny kernel ran on it: torch.cuda.is_available() says nothing about a driver
too old for this build, a GPU this build has no kernels for, or a device index past the visible ones, and those would
otherwise fail later, mid-load, with torch's own message.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

from tandem.core.model_options import DTYPE_NAMES
from tandem.errors import InvalidArgument

log = logging.getLogger(__name__)

DTYPES = {name: getattr(torch, attribute) for name, attribute in DTYPE_NAMES.items()}

# The oldest Linux driver a CUDA major's runtime runs on (NVIDIA's minor-version compatibility: 12.x from r525,
# 13.x from r580, the 13.0 GA driver's number). What to ask for when the driver is too old for this torch.
MIN_DRIVER = {"12": "525.60.13", "13": "580.65.06"}
NVIDIA_DRIVER_VERSION = Path("/proc/driver/nvidia/version")
CUDA_WHEELS = "https://download.pytorch.org/whl"


class CudaUnavailable(InvalidArgument):
    """--device cuda[:N] was asked for and this machine cannot run CUDA kernels there; the message says why."""


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """True when the CPU has AVX512-BF16 or AMX, where bf16 matmuls beat float32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _bf16_kernel_runs() -> bool:
    from tandem.core import bf16_linear  # it builds on this module

    return bf16_linear.ENABLED[0] and bf16_linear.ready()


def cpu_runs_avx512() -> bool:
    """True when torch's CPU kernels run at AVX-512 or above here (its own dispatch, which honours
    ATEN_CPU_CAPABILITY): where tandem's AVX-512 paths run, the decode-attention kernel and the w4 draft."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX512_BF16", "AMX")


def cuda_build() -> str | None:
    """The CUDA (or ROCm) version this torch was built for; None for a CPU-only build."""
    return torch.version.cuda or getattr(torch.version, "hip", None)


def driver_version() -> str | None:
    """The loaded NVIDIA kernel driver's version ("580.95.05"), None when no NVIDIA driver is loaded."""
    try:
        first = NVIDIA_DRIVER_VERSION.read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.95.05  <date>" (or "... Open Kernel Module for x86_64 ...")
    return next((word for word in first.split() if word[:1].isdigit() and "." in word), None)


def _visible_devices() -> str:
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "" if value is None else f" (CUDA_VISIBLE_DEVICES={value!r})"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _run_test_kernel(index: int) -> None:
    """Allocate on cuda:index and run one kernel; .item() synchronises, so an asynchronous kernel error lands here."""
    x = torch.arange(8, device=torch.device("cuda", index), dtype=torch.float32)
    if (x * 2).sum().item() != 56.0:
        raise RuntimeError(f"a test kernel on cuda:{index} returned a wrong result")


def _build_and_driver() -> str:
    if torch.version.hip:
        return f"torch {torch.__version__} is built for ROCm {torch.version.hip}"
    text = f"torch {torch.__version__} is built for CUDA {torch.version.cuda}"
    needs = MIN_DRIVER.get(str(torch.version.cuda).split(".")[0])
    if needs:
        text += f", which needs an NVIDIA driver >= {needs}"
    driver = driver_version()
    return text + (f"; the loaded driver is {driver}" if driver else "; no NVIDIA driver is loaded")


def cuda_problem(index: int = 0) -> str | None:
    """Why cuda:index cannot run kernels here, with what to do about it; None when it can."""
    if cuda_build() is None:
        return (f"this torch ({torch.__version__}) is a CPU-only build. Install a CUDA build "
                f"(pip install torch=={torch.__version__.split('+')[0]} --index-url {CUDA_WHEELS}/cu130), "
                "use the CUDA image (deploy/Dockerfile), or pass --device cpu")
    advice = ("Check the GPU with nvidia-smi (in Kubernetes: the pod requests nvidia.com/gpu and the node runs the "
              f"NVIDIA device plugin), update the driver, or install a torch built for an older CUDA "
              f"({CUDA_WHEELS}/cu126 needs a driver >= {MIN_DRIVER['12']}); or pass --device cpu")
    if torch.version.hip:
        advice = "Check the GPU with rocm-smi and the ROCm driver's version; or pass --device cpu"
    try:
        torch.cuda.init()
        count = torch.cuda.device_count()
    except (RuntimeError, AssertionError) as exc:
        return (f"CUDA failed to initialise: {_first_line(exc)}{_visible_devices()}. {_build_and_driver()}. "
                f"{advice}")
    if count == 0:
        return f"no CUDA device is visible{_visible_devices()}. {_build_and_driver()}. {advice}"
    if index >= count:
        return (f"cuda:{index} is past the {count} visible CUDA device(s){_visible_devices()}: "
                f"use cuda:0 to cuda:{count - 1}")
    try:
        _run_test_kernel(index)
    except RuntimeError as exc:
        archs = " ".join(torch.cuda.get_arch_list())
        return (f"a test kernel on cuda:{index} failed: {_first_line(exc)}. {_build_and_driver()}; this build has "
                f"kernels for {archs or 'no architectures'}. The GPU may be busy, in exclusive mode, or too new or "
                f"old for this build. {advice}")
    return None


def _auto_device() -> torch.device:
    if cuda_build() is None:
        return torch.device("cpu")  # a CPU-only torch: CPU is what was installed, nothing to warn about
    if os.environ.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1"):
        # GPUs hidden on purpose (Ray does this for actors that asked for no GPU): a choice, not a failure.
        log.info("device auto: cpu (GPUs hidden by CUDA_VISIBLE_DEVICES=%r)", os.environ["CUDA_VISIBLE_DEVICES"])
        return torch.device("cpu")
    problem = cuda_problem(0)
    if problem is None:
        return torch.device("cuda")
    log.warning("device auto: using cpu, not cuda: %s", problem)
    return torch.device("cpu")


def select_device(name: str = "auto") -> torch.device:
    """auto, cpu, cuda or cuda:N. A CUDA device is probed first; CudaUnavailable says why it cannot be used."""
    if name == "auto":
        return _auto_device()
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise InvalidArgument(f"device: unknown device {name!r} (use auto, cpu, cuda or cuda:N)") from exc
    if device.type == "cuda":
        problem = cuda_problem(device.index or 0)
        if problem is not None:
            raise CudaUnavailable(f"device: {name!r} requested, but {problem}")
    return device


def on_device(data, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`data` (a list, or a tensor) as a tensor on `device`; from the host to a GPU, queued behind the device's work
    rather than waiting for it. torch's blocking copy to a GPU synchronizes the stream once it is queued: in a decode
    step that holds the host until the forward ends before it queues the head and the choice, so the GPU idles while
    they are launched. From ordinary (pageable) memory CUDA reads the data before the call returns, so the
    temporary may go at once. Any other copy (to the host above all, whose data must have arrived when it is read)
    stays blocking."""
    tensor = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    to_gpu = tensor.device.type == "cpu" and torch.device(device).type != "cpu"
    return tensor.to(device, dtype=dtype or tensor.dtype, non_blocking=to_gpu)


def select_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bf16 on a GPU, and on a CPU with fast bf16 products: AVX512-BF16 or AMX, or tandem's bf16 kernel
    (core.bf16_linear, built here on first ask), whose products stream bf16 weights at the memory's rate on an AVX2
    CPU too, where float32 reads twice the bytes; float32 elsewhere."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_fast_bf16() or _bf16_kernel_runs() else torch.float32
    if name not in DTYPES:
        raise InvalidArgument(f"dtype: unknown dtype {name!r} (use auto, {', '.join(sorted(DTYPES))})")
    return DTYPES[name]
