"""Where tandem's CPU kernels build (core.cpu_kernels.build_copy): one directory per source, flags and installation.
torch's extension builder rebuilds whenever its command changes, and the command names the installation's torch
headers and libraries, Python's headers and the compiler: two venvs sharing one directory rebuilt it at every
change of venv (10-13 s a kernel, docs/performance.md "Start-up: the CPU attention kernel's build")."""

from __future__ import annotations

from pathlib import Path

import torch

from tandem.core import cpu_kernels
from tandem.core.cpu_attention import SOURCE


def test_each_installation_builds_in_a_directory_of_its_own(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    here = cpu_kernels.installation()
    assert here[0] == str(Path(torch.__file__).parent)
    directory = cpu_kernels.build_copy(SOURCE).parent
    assert cpu_kernels.build_copy(SOURCE, install=here).parent == directory  # the default is this process's
    assert directory.parent == tmp_path / "kernels" and directory.name.startswith(f"{SOURCE.stem}-torch")
    for other in (("/elsewhere/torch", *here[1:]), (here[0], "/other/python/include", here[2]), (*here[:2], "clang++")):
        elsewhere = cpu_kernels.build_copy(SOURCE, install=other).parent
        assert elsewhere != directory and (elsewhere / SOURCE.name).read_bytes() == SOURCE.read_bytes()
    monkeypatch.setenv("CXX", "clang++")  # the compiler the build would run
    clang = cpu_kernels.build_copy(SOURCE, install=(*here[:2], "clang++")).parent
    assert cpu_kernels.build_copy(SOURCE).parent == clang
