"""Building tandem's own CPU kernels (csrc/): each source once per machine, with the compiler torch.compile already
needs and ninja, into a library that registers its op's CPU kernel (core.cpu_attention, core.bf16_linear)."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from tandem.core.device import cpu_runs_avx512

log = logging.getLogger(__name__)

# The instruction sets every AVX-512 CPU torch dispatches to has (AVX512-BF16 is asked per function, where used).
CFLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-fopenmp")
# OpenMP: at::parallel_for spreads a kernel's tasks over torch's threads only in code built with it (its libgomp is
# the one torch has loaded); without, the attention kernel ran on one thread, 1.23x sdpa's time in a forward.
LDFLAGS = ("-fopenmp",)


def build(source: Path, what: str) -> bool:
    """Build and load the library of `source` (its op's CPU kernel registers as it loads); False, with the reason
    logged, where it cannot run here: no AVX-512, no C++ compiler, a broken toolchain."""
    if not cpu_runs_avx512():
        log.info("%s: no AVX-512 here, torch's own kernels run", what)
        return False
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        log.info("%s: no C++ compiler, torch's own kernels run", what)
        return False
    from torch.utils.cpp_extension import load

    started = time.perf_counter()
    copy = build_copy(source)
    log.info("loading the %s from %s (built once per machine: about 30 s)", what, copy.parent)
    try:
        load(f"tandem_{source.stem}", [str(copy)], build_directory=str(copy.parent), is_python_module=False,
             extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS), verbose=False)  # lists it extends
    except (RuntimeError, OSError, ImportError) as error:  # a broken toolchain, no ninja: run as without the kernel
        log.warning("%s: the kernel did not build (%s), torch's own kernels run", what, error)
        return False
    log.info("%s ready in %.1f s", what, time.perf_counter() - started)
    return True


def build_copy(source: Path) -> Path:
    """The source as the build compiles it: a copy in a build directory named by torch's version and a digest of the
    source and flags. torch's extension builder rebuilds whenever the source's path changes, so compiling the
    package's own file rebuilt it (10-30 s) for every checkout, worktree or install on a machine; from the copy, each
    of them reuses the one build of the same code, and another version of it builds beside it."""
    from tandem.models.store import default_root

    code = source.read_bytes()
    digest = hashlib.sha256(code + " ".join(CFLAGS + LDFLAGS).encode()).hexdigest()[:12]
    directory = default_root() / "kernels" / f"{source.stem}-torch{torch.__version__}-{digest}"
    directory.mkdir(parents=True, exist_ok=True)
    copy = directory / source.name
    if not copy.is_file() or copy.read_bytes() != code:  # written whole or not at all: builds may run side by side
        partial = directory / f"{source.name}.{os.getpid()}.partial"
        partial.write_bytes(code)
        os.replace(partial, copy)
    return copy
