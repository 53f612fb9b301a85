"""--device: CUDA is probed before use, and every way it can be unusable gives an error that says why and what to do.

The paths of a machine without a usable GPU run for real here (a CPU-only torch, or a CUDA build with no GPU); the
paths of a CUDA build (driver too old, device index past the visible ones, a kernel that fails) are simulated by
replacing torch.cuda's probes. On a machine with a GPU the last tests probe it for real.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from tandem.core import device as dev
from tandem.core.device import CudaUnavailable, cuda_build, select_device
from tandem.errors import InvalidArgument, TandemError

HAS_GPU = torch.cuda.is_available()
no_gpu = pytest.mark.skipif(HAS_GPU, reason="this machine has a usable GPU")
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
DRIVER_FILE = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  {}  Wed Jan 22 17:19:02 UTC 2025\nGCC version:  12.2.0\n"


@no_gpu
@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:5"])
def test_cuda_on_this_machine_fails_with_the_reason(name: str) -> None:
    with pytest.raises(CudaUnavailable) as info:
        select_device(name)
    message = str(info.value)
    assert message.startswith(f"device: {name!r} requested, but ")
    assert "--device cpu" in message
    if cuda_build() is None:
        assert f"this torch ({torch.__version__}) is a CPU-only build" in message
        assert "--index-url https://download.pytorch.org/whl/cu130" in message
    assert isinstance(info.value, InvalidArgument) and isinstance(info.value, TandemError)  # the CLI exits 2


@pytest.mark.skipif(cuda_build() is not None, reason="a CUDA build of torch is installed")
def test_auto_on_a_cpu_build_picks_cpu_without_a_warning(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="tandem.core.device"):
        assert select_device("auto") == torch.device("cpu")
    assert not caplog.records


def test_unknown_names_and_cpu() -> None:
    assert select_device("cpu") == torch.device("cpu")
    with pytest.raises(InvalidArgument, match="unknown device 'quantum'") as info:
        select_device("quantum")
    assert not isinstance(info.value, CudaUnavailable)


@no_gpu
def test_cli_reports_an_unusable_cuda_device_before_loading_models(capsys, tiny_dirs) -> None:
    from tandem.cli.main import main

    code = main(["generate", "x", "--target", str(tiny_dirs.target), "--no-spec", "--device", "cuda:5"])
    assert code == 2
    err = capsys.readouterr().err
    assert "error: --device: 'cuda:5' requested, but " in err and "Traceback" not in err
    # serving its models itself, `tandem serve` says so before it starts serving anything
    code = main(["serve", "--in-process", "--target", str(tiny_dirs.target), "--no-spec", "--device", "cuda:5",
                 "--port", "0", "--http-port", "-1", "--metrics-port", "-1"])
    out, err = capsys.readouterr()
    assert code == 2 and "error: --device: 'cuda:5' requested, but " in err and "serving" not in out + err


class FakeCuda:
    """A CUDA 13.0 build of torch as device.py sees it, with the driver, devices and test kernel chosen per test."""

    def __init__(self, monkeypatch, tmp_path) -> None:
        self.init_error: str | None = None
        self.count = 1
        self.kernel_error: str | None = None
        self.driver_file = tmp_path / "nvidia-version"
        self.driver_file.write_text(DRIVER_FILE.format("580.95.05"))
        monkeypatch.setattr(torch.version, "cuda", "13.0")
        monkeypatch.setattr(torch.version, "hip", None, raising=False)
        monkeypatch.setattr(torch.cuda, "init", self._init)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100"])
        monkeypatch.setattr(dev, "_run_test_kernel", self._kernel)
        monkeypatch.setattr(dev, "NVIDIA_DRIVER_VERSION", self.driver_file)
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def _init(self) -> None:
        if self.init_error:
            raise RuntimeError(self.init_error)

    def _kernel(self, index: int) -> None:
        if self.kernel_error:
            raise RuntimeError(self.kernel_error)


@pytest.fixture
def fake_cuda(monkeypatch, tmp_path) -> FakeCuda:
    return FakeCuda(monkeypatch, tmp_path)


def test_a_working_gpu_is_selected(fake_cuda, caplog) -> None:
    fake_cuda.count = 2
    assert select_device("cuda") == torch.device("cuda")
    assert select_device("cuda:1") == torch.device("cuda", 1)
    with caplog.at_level(logging.INFO, logger="tandem.core.device"):
        assert select_device("auto") == torch.device("cuda")
    assert not caplog.records


def test_driver_too_old_names_the_build_the_driver_and_the_fix(fake_cuda, caplog) -> None:
    fake_cuda.init_error = ("The NVIDIA driver on your system is too old (found version 12040). Please update your "
                            "GPU driver by downloading and installing a new version from the URL: ...\nsecond line")
    fake_cuda.driver_file.write_text(DRIVER_FILE.format("550.54.14"))
    with pytest.raises(CudaUnavailable) as info:
        select_device("cuda")
    message = str(info.value)
    assert "CUDA failed to initialise: The NVIDIA driver on your system is too old (found version 12040)" in message
    assert "second line" not in message
    assert f"torch {torch.__version__} is built for CUDA 13.0, which needs an NVIDIA driver >= 580.65.06" in message
    assert "the loaded driver is 550.54.14" in message
    assert "https://download.pytorch.org/whl/cu126 needs a driver >= 525.60.13" in message
    assert "nvidia-smi" in message and "--device cpu" in message

    # auto does not fall back silently: it warns with the same reason and says it uses the CPU.
    with caplog.at_level(logging.WARNING, logger="tandem.core.device"):
        assert select_device("auto") == torch.device("cpu")
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith("device auto: using cpu, not cuda: CUDA failed to initialise: The NVIDIA")


def test_no_driver_loaded(fake_cuda) -> None:
    fake_cuda.init_error = "Found no NVIDIA driver on your system. Please check that you have an NVIDIA GPU"
    fake_cuda.driver_file.unlink()
    with pytest.raises(CudaUnavailable, match=r"Found no NVIDIA driver.*; no NVIDIA driver is loaded"):
        select_device("cuda:0")


@pytest.mark.parametrize("count", [0, 1, 2])
def test_an_index_past_the_visible_devices(fake_cuda, monkeypatch, count: int) -> None:
    fake_cuda.count = count
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(count))) or "")
    with pytest.raises(CudaUnavailable) as info:
        select_device("cuda:5")
    message = str(info.value)
    if count:
        assert f"cuda:5 is past the {count} visible CUDA device(s)" in message
        assert f"use cuda:0 to cuda:{count - 1}" in message
    else:
        assert "no CUDA device is visible (CUDA_VISIBLE_DEVICES='')" in message


def test_a_failing_test_kernel_is_caught_before_the_model_loads(fake_cuda, caplog) -> None:
    fake_cuda.kernel_error = "CUDA error: no kernel image is available for execution on the device"
    with pytest.raises(CudaUnavailable) as info:
        select_device("cuda")
    message = str(info.value)
    assert "a test kernel on cuda:0 failed: CUDA error: no kernel image is available" in message
    assert "kernels for sm_75 sm_80 sm_86 sm_90 sm_100" in message
    with caplog.at_level(logging.WARNING, logger="tandem.core.device"):
        assert select_device("auto") == torch.device("cpu")
    assert "no kernel image" in caplog.records[0].getMessage()


@pytest.mark.parametrize("hidden", ["", "-1"])
def test_auto_takes_gpus_hidden_on_purpose_quietly(fake_cuda, monkeypatch, caplog, hidden: str) -> None:
    # Ray sets CUDA_VISIBLE_DEVICES="" for an actor that asked for no GPU: CPU is the intent, not a failure.
    fake_cuda.init_error = "No CUDA GPUs are available"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
    with caplog.at_level(logging.INFO, logger="tandem.core.device"):
        assert select_device("auto") == torch.device("cpu")
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    with pytest.raises(CudaUnavailable, match=f"No CUDA GPUs are available \\(CUDA_VISIBLE_DEVICES='{hidden}'\\)"):
        select_device("cuda")


def test_auto_warns_on_a_cuda_build_without_gpus(fake_cuda, caplog) -> None:
    fake_cuda.count = 0
    with caplog.at_level(logging.WARNING, logger="tandem.core.device"):
        assert select_device("auto") == torch.device("cpu")
    assert "no CUDA device is visible" in caplog.records[0].getMessage()


def test_rocm_builds_are_cuda_builds(fake_cuda, monkeypatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", "7.2.0")
    fake_cuda.init_error = "No HIP GPUs are available"
    with pytest.raises(CudaUnavailable, match=r"built for ROCm 7\.2\.0") as info:
        select_device("cuda")
    assert "CPU-only" not in str(info.value) and "rocm-smi" in str(info.value) and "NVIDIA" not in str(info.value)


@gpu
def test_a_real_gpu() -> None:
    count = torch.cuda.device_count()
    assert select_device("cuda") == torch.device("cuda")
    assert select_device(f"cuda:{count - 1}") == torch.device("cuda", count - 1)
    assert select_device("auto") == torch.device("cuda")
    with pytest.raises(CudaUnavailable, match=f"cuda:{count} is past the {count} visible CUDA device"):
        select_device(f"cuda:{count}")


@gpu
def test_a_real_gpu_hidden_by_cuda_visible_devices() -> None:
    # A fresh process: CUDA reads CUDA_VISIBLE_DEVICES once, at initialisation.
    script = ("import logging, torch; logging.basicConfig(level=logging.INFO)\n"
              "from tandem.core.device import select_device, CudaUnavailable\n"
              "print('auto', select_device('auto'))\n"
              "try:\n    select_device('cuda')\nexcept CudaUnavailable as exc:\n    print('error', exc)\n")
    env = os.environ | {"CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert "auto cpu" in out.stdout, out.stderr
    assert "error device: 'cuda' requested, but " in out.stdout and "CUDA_VISIBLE_DEVICES=''" in out.stdout
    assert "WARNING" not in out.stderr


def test_on_device_makes_the_tensor_asked_for_and_leaves_one_in_place_alone() -> None:
    made = dev.on_device([3, 1, 2], "cpu", torch.long)
    assert made.dtype == torch.long and made.tolist() == [3, 1, 2]
    assert dev.on_device([0.5, 1.0], torch.device("cpu")).dtype == torch.float32
    kept = torch.arange(4)
    assert dev.on_device(kept, "cpu") is kept  # nothing copied where it already is
    assert dev.on_device(kept, "cpu", torch.float64).tolist() == [0.0, 1.0, 2.0, 3.0]


@gpu
def test_on_device_copies_to_a_gpu_without_waiting_for_it_and_to_the_host_with() -> None:
    """torch's sync debug mode raises on any call that waits for the GPU: the copy from the host must not (a plain
    torch.tensor(..., device="cuda") does), the copy back must (its data has to be there when read)."""
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # work queued ahead of the copies
        busy = busy @ busy / 4096
    torch.cuda.set_sync_debug_mode("error")
    try:
        on_gpu = dev.on_device([1, 2, 3], "cuda")
        with pytest.raises(RuntimeError, match="synchroniz"):
            torch.tensor([1, 2, 3], device="cuda")
        with pytest.raises(RuntimeError, match="synchroniz"):
            dev.on_device(on_gpu, "cpu")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert on_gpu.tolist() == [1, 2, 3]
