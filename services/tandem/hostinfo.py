"""What a host is, as far as how fast it runs a model: its CPU model, the cores this process may use, its NVIDIA
GPUs. Read from /proc (the driver's files for the GPUs: asking torch would create a CUDA context in a gateway).
Workers report it in their info; a calibration file keys stored costs by it (engines.calibration_file)."""

from __future__ import annotations

import os
import platform
from functools import cache
from pathlib import Path


@cache
def host_facts() -> dict:
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
