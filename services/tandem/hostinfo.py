"""What a host is, as far as how fast it runs a model: its CPU model, the cores this process may use, its NVIDIA
GPUs, and the path tandem's bf16 linear kernel took in this process where it loaded one (a probe picks it per
machine: core.bf16_linear). Read from /proc (the driver's files for the GPUs: asking torch would create a CUDA
context in a gateway). Workers report it in their info; a calibration file keys stored costs by it
(engines.calibration_file)."""

from __future__ import annotations

import os
import platform
import sys
from functools import cache
from pathlib import Path


def host_facts() -> dict:
    kernel = sys.modules.get("tandem.core.bf16_linear")  # never imported here: a gateway has no torch to spare
    path = kernel.path_name() if kernel is not None else None
    return _machine() | ({"cpu_linear_path": path} if path is not None else {})


@cache
def _machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), platform.processor())
    gpus = sorted(line.split(":", 1)[1].strip() for info in Path("/proc/driver/nvidia/gpus").glob("*/information")
                  for line in _read(info).splitlines() if line.startswith("Model:"))
    return {"machine": platform.machine(), "cpu": cpu, "cores": len(os.sched_getaffinity(0)), "gpus": gpus}


def _read(path: str | Path) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""
