"""Which OpenMP runtime and allocator torch runs on, and the LD_PRELOAD that runs it faster on a CPU.

torch's PyPI wheels run their CPU thread pool on libgomp (GNU OpenMP) and allocate with glibc's malloc. Preloading
Intel's OpenMP runtime (libiomp5, from PyPI's intel-openmp: `pip install '.[cpu]'` in the checkout puts it in the
environment's lib/) and tcmalloc (Debian's libtcmalloc-minimal4) makes torch run on them instead: libiomp5 answers
the GOMP_* calls that torch, oneDNN, inductor's kernels and core.cpu_attention make. vLLM's CPU guide asks for the
same two. On CPU-A it ran tandem's engines at 8 requests at once 1.04-1.06x faster (docs/performance.md, "Intel's
OpenMP runtime and tcmalloc"). Only a preload can do it: a library loaded after torch is too late, so this module
only reports what the process runs on and says what to set.
"""

from __future__ import annotations

import functools
import logging
import platform
import sys
from pathlib import Path

log = logging.getLogger(__name__)

TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4")
MAPS = Path("/proc/self/maps")
INSTALL = {"libiomp5": "`pip install '.[cpu]'` in tandem's checkout (intel-openmp)",
           "tcmalloc": "`apt-get install libtcmalloc-minimal4`"}


def loaded(maps: str | None = None) -> dict[str, bool]:
    """Whether this process has mapped Intel's OpenMP runtime and tcmalloc (from /proc/self/maps unless given)."""
    if maps is None:
        try:
            maps = MAPS.read_text()
        except OSError:  # not Linux: nothing to say
            maps = ""
    return {"libiomp5": "libiomp5" in maps, "tcmalloc": "libtcmalloc" in maps}


def iomp_path() -> Path:
    """Where PyPI's intel-openmp puts libiomp5 in this environment (its wheel installs into the prefix's lib/)."""
    return Path(sys.prefix) / "lib" / "libiomp5.so"


def tcmalloc_path() -> str | None:
    """The first of TCMALLOC installed here."""
    return next((p for p in TCMALLOC if Path(p).is_file()), None)


def suggested_preload(iomp: Path | None = None) -> str:
    """LD_PRELOAD for this machine: tcmalloc and libiomp5 (`iomp`, by default this environment's), those of them
    installed, in the order vLLM's guide gives."""
    return ":".join(str(p) for p in (tcmalloc_path(), iomp or iomp_path()) if p is not None and Path(p).is_file())


@functools.cache
def advise() -> bool:
    """Once per process, on x86-64 Linux: a warning naming what is missing and how to preload it. True when both
    are loaded."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return True
    missing = [name for name, present in loaded().items() if not present]
    if not missing:
        return True
    preload = suggested_preload()
    how = [f"start tandem with LD_PRELOAD={preload}"] if preload else []
    installed = {"libiomp5": iomp_path().is_file(), "tcmalloc": tcmalloc_path() is not None}
    absent = [INSTALL[name] for name in missing if not installed[name]]
    if absent:
        how.append(f"install {' and '.join(absent)} and preload {'them' if len(absent) > 1 else 'it'}")
    log.warning("this CPU process runs without %s: %s (about 1.05x faster at 8 requests at once on CPU-A; "
                "docs/operations.md, 'On a CPU')", " and ".join(missing), "; ".join(how))
    return False
