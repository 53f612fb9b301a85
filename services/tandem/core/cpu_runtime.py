"""Which OpenMP runtime and allocator torch runs on, and the LD_PRELOAD that runs it on others.

torch's PyPI wheels run their CPU thread pool on libgomp (GNU OpenMP) and allocate with glibc's malloc. Preloading
Intel's OpenMP runtime (libiomp5, from PyPI's intel-openmp: `pip install '.[cpu]'` in the checkout puts it in the
environment's lib/) and tcmalloc (Debian's libtcmalloc-minimal4) makes torch run on them instead: libiomp5 answers
the GOMP_* calls that torch, oneDNN, inductor's kernels and tandem's CPU kernels make. vLLM's CPU guide asks for the
same two. What it buys tandem depends on the process: resident engines at 8 requests at once ran 1.04-1.06x faster on
CPU-A (v35's engines), but `tandem serve --in-process` at 8 in flight read 0.95x plain and 1.03x AUTO, repeats
spread 0.86-1.18x (docs/performance.md, "Intel's OpenMP runtime and tcmalloc"). So it is opt-in: TANDEM_PRELOAD=1
has the `tandem` command run itself again with the preload before it imports anything (`preload_environment`,
tandem.cli.main.run); only a preload can do it, a library loaded after torch is too late. `advise` says what a
process runs on.
"""

from __future__ import annotations

import functools
import logging
import platform
import sys
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)

TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4")
MAPS = Path("/proc/self/maps")
NVIDIA_DRIVER = Path("/proc/driver/nvidia")
PRELOAD_ENV = "TANDEM_PRELOAD"  # "1": the `tandem` command runs itself again with tcmalloc and libiomp5 preloaded
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


def preload_environment(env: Mapping[str, str]) -> dict[str, str] | None:
    """`env` with LD_PRELOAD naming tcmalloc and libiomp5 (those installed), for a process to run itself again in,
    where TANDEM_PRELOAD=1 asks; None where it should go on as it is: not asked; not x86-64 Linux; a machine with an
    NVIDIA driver (a GPU's processes run on what their torch links, as the chart's GPU pods do); LD_PRELOAD already
    set (the operator's own, or this very preload: a process run again never runs again); or neither library
    installed. Ray workers that a process starts inherit its environment, so a local cluster's run on it too."""
    if env.get(PRELOAD_ENV) != "1" or sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    if env.get("LD_PRELOAD") or NVIDIA_DRIVER.exists():
        return None
    preload = suggested_preload()
    return dict(env) | {"LD_PRELOAD": preload} if preload else None


@functools.cache
def advise() -> bool:
    """Once per process, on x86-64 Linux: a line at INFO naming what it runs without and how to preload it (not a
    warning: served, it has not been shown to pay). True when both are loaded."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return True
    missing = [name for name, present in loaded().items() if not present]
    if not missing:
        return True
    preload = suggested_preload()
    how = [f"{PRELOAD_ENV}=1 (the `tandem` command) or LD_PRELOAD={preload} preloads them"] if preload else []
    installed = {"libiomp5": iomp_path().is_file(), "tcmalloc": tcmalloc_path() is not None}
    absent = [INSTALL[name] for name in missing if not installed[name]]
    if absent:
        how.append(f"install {' and '.join(absent)} to preload {'them' if len(absent) > 1 else 'it'}")
    log.info("this CPU process runs without %s: %s (resident engines 1.04-1.06x at 8 at once, served in-process "
             "0.95-1.03x; docs/operations.md, 'On a CPU')", " and ".join(missing), "; ".join(how))
    return False
