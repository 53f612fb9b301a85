"""Building tandem's own CPU kernels (csrc/): each source once per installation (a venv's torch), with the compiler
torch.compile already needs and ninja, into a library that registers its op's CPU kernel (core.cpu_attention,
core.bf16_linear)."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sysconfig
import time
from pathlib import Path

import torch

from tandem.core.device import cpu_runs_avx512

log = logging.getLogger(__name__)

CFLAGS = ("-O3", "-fopenmp")
# The instruction sets every AVX-512 CPU torch dispatches to has (AVX512-BF16 is asked per function, where used), for
# a source written for AVX-512 alone; one with a path per instruction set names each path's in its target attribute.
AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
# OpenMP: at::parallel_for spreads a kernel's tasks over torch's threads only in code built with it (its libgomp is
# the one torch has loaded); without, the attention kernel ran on one thread, 1.23x sdpa's time in a forward.
LDFLAGS = ("-fopenmp",)


def build(source: Path, what: str, isa: tuple[str, ...] = AVX512) -> bool:
    """Build and load the library of `source` (its op's CPU kernel registers as it loads), compiled for the
    instruction sets `isa` flags (none: it picks its own per function); False, with the reason logged, where it
    cannot run here: AVX-512 flagged on a CPU without it, no C++ compiler, a broken toolchain."""
    if isa and not cpu_runs_avx512():
        log.info("%s: no AVX-512 here, torch's own kernels run", what)
        return False
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        log.info("%s: no C++ compiler, torch's own kernels run", what)
        return False
    from torch.utils.cpp_extension import load

    started = time.perf_counter()
    copy = build_copy(source, isa)
    log.info("loading the %s from %s (built once per installation: about 30 s)", what, copy.parent)
    try:
        load(f"tandem_{source.stem}", [str(copy)], build_directory=str(copy.parent), is_python_module=False,
             extra_cflags=list(CFLAGS + isa), extra_ldflags=list(LDFLAGS), verbose=False)  # lists it extends
    except (RuntimeError, OSError, ImportError) as error:  # a broken toolchain, no ninja: run as without the kernel
        log.warning("%s: the kernel did not build (%s), torch's own kernels run", what, error)
        return False
    log.info("%s ready in %.1f s", what, time.perf_counter() - started)
    return True


def build_copy(source: Path, isa: tuple[str, ...] = AVX512, install: tuple[str, ...] | None = None) -> Path:
    """The source as the build compiles it: a copy in a build directory named by torch's version and a digest of the
    source, the flags and the installation that compiles it (`install`, default `installation()`). torch's extension
    builder rebuilds whenever its command changes: compiling the package's own file, whose path is in the command,
    rebuilt it (10-30 s) for every checkout or worktree on a machine, and one directory for every installation (each
    venv's torch headers and libraries are in the command) rebuilt it at every change of venv. From the copy, every
    checkout run by one installation reuses the one build of the same code; another installation, or another version
    of the code, builds once beside it."""
    from tandem.models.store import default_root

    code = source.read_bytes()
    compiles = CFLAGS + isa + LDFLAGS + (install if install is not None else installation())
    digest = hashlib.sha256(code + "\0".join(compiles).encode()).hexdigest()[:12]
    directory = default_root() / "kernels" / f"{source.stem}-torch{torch.__version__}-{digest}"
    directory.mkdir(parents=True, exist_ok=True)
    copy = directory / source.name
    if not copy.is_file() or copy.read_bytes() != code:  # written whole or not at all: builds may run side by side
        partial = directory / f"{source.name}.{os.getpid()}.partial"
        partial.write_bytes(code)
        os.replace(partial, copy)
    return copy


def installation() -> tuple[str, ...]:
    """What of this process's installation the build's command names: torch's directory (its headers and libraries),
    Python's headers and the compiler."""
    return os.path.dirname(torch.__file__), sysconfig.get_paths()["include"], os.environ.get("CXX", "c++")
