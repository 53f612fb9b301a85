"""core.cpu_runtime: what a CPU process runs torch on, and the LD_PRELOAD it suggests. The preloaded runs are real
processes with Intel's OpenMP runtime (the dev extra installs intel-openmp) and tcmalloc (CI installs Debian's
libtcmalloc-minimal4) preloaded, doing torch's parallel work and the CPU attention kernel's there."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tandem.core import cpu_runtime

x86_linux = pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64",
                               reason="intel-openmp and the advice are for x86-64 Linux")
PROBE = """
import json, logging, torch
logging.basicConfig(level=logging.INFO)
from tandem.core import cpu_attention, cpu_runtime
torch.set_num_threads(2)
torch.manual_seed(0)
a, b = torch.randn(512, 384), torch.randn(384, 256)
result = {"loaded": cpu_runtime.loaded(), "advised_ok": cpu_runtime.advise(), "threads": torch.get_num_threads(),
          "matmul": (a @ b)[:4].flatten().tolist(), "sum": torch.arange(1 << 20, dtype=torch.float64).sum().item()}
if cpu_attention.ready():  # its OpenMP loop runs on whichever runtime answers GOMP_parallel
    q = torch.randn(8, 2, 6, 64).bfloat16()  # 8 rows, 2 key/value heads, 6 queries each: 16 tasks for 2 threads
    k, v = torch.randn(8, 2, 40, 64).bfloat16(), torch.randn(8, 2, 40, 64).bfloat16()
    result["attention"] = cpu_attention.decode_attention(q, k, v, None, 0.125).float().flatten().tolist()
print(json.dumps(result))
"""


def probe(preload: str | None) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"} | {"PYTHONPATH": os.pathsep.join(sys.path)}
    if preload:
        env["LD_PRELOAD"] = preload
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_what_a_process_has_mapped_is_read_from_its_maps() -> None:
    maps = ("7f00-7f10 r-xp 00000000 08:01 12 /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.16\n"
            "7f20-7f30 r-xp 00000000 08:01 13 /venv/lib/libiomp5.so\n")
    assert cpu_runtime.loaded(maps) == {"libiomp5": True, "tcmalloc": True}
    assert cpu_runtime.loaded("7f00-7f10 r-xp 0 08:01 9 /venv/lib/python3.11/site-packages/torch/lib/libgomp.so.1\n") \
        == {"libiomp5": False, "tcmalloc": False}
    preloaded = os.environ.get("LD_PRELOAD", "")  # CI runs pytest on torch's own; a developer may preload
    assert cpu_runtime.loaded() == {"libiomp5": "libiomp5" in preloaded, "tcmalloc": "libtcmalloc" in preloaded}


def test_the_suggested_preload_names_only_installed_libraries(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(cpu_runtime.sys, "prefix", str(tmp_path))
    monkeypatch.setattr(cpu_runtime, "TCMALLOC", (str(tmp_path / "missing.so"),))
    assert cpu_runtime.suggested_preload() == ""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    (tmp_path / "tcmalloc.so").write_bytes(b"")
    monkeypatch.setattr(cpu_runtime, "TCMALLOC", (str(tmp_path / "missing.so"), str(tmp_path / "tcmalloc.so")))
    assert cpu_runtime.suggested_preload() == f"{tmp_path / 'tcmalloc.so'}:{tmp_path / 'lib' / 'libiomp5.so'}"


@x86_linux
def test_without_a_preload_a_process_is_told_what_to_preload() -> None:
    result, stderr = probe(None)
    assert result["loaded"] == {"libiomp5": False, "tcmalloc": False} and not result["advised_ok"]
    (line,) = [line for line in stderr.splitlines() if "without libiomp5 and tcmalloc" in line]
    preload = cpu_runtime.suggested_preload()
    assert line.startswith("INFO:tandem.core.cpu_runtime") and (f"LD_PRELOAD={preload}" in line) == bool(preload)
    for name, install in cpu_runtime.INSTALL.items():  # how to get what this machine lacks, and only that
        assert (install in line) == (name not in preload.replace("libtcmalloc", "tcmalloc"))


def test_the_advice_names_how_to_install_what_is_not_installed(tmp_path: Path, monkeypatch, caplog) -> None:
    monkeypatch.setattr(cpu_runtime.sys, "prefix", str(tmp_path))  # no libiomp5 in this environment
    monkeypatch.setattr(cpu_runtime, "TCMALLOC", (str(tmp_path / "missing.so"),))  # tcmalloc: mapped, file elsewhere
    monkeypatch.setattr(cpu_runtime, "loaded", lambda: {"libiomp5": False, "tcmalloc": True})
    cpu_runtime.advise.cache_clear()
    try:
        with caplog.at_level("INFO", logger="tandem.core.cpu_runtime"):
            assert cpu_runtime.advise() is (sys.platform != "linux" or platform.machine() != "x86_64")
    finally:
        cpu_runtime.advise.cache_clear()
    if sys.platform == "linux" and platform.machine() == "x86_64":
        (record,) = caplog.records
        assert "runs without libiomp5:" in record.getMessage() and "LD_PRELOAD" not in record.getMessage()
        assert "install `pip install '.[cpu]'` in tandem's checkout (intel-openmp) to preload it" in record.getMessage()


@x86_linux
def test_preloaded_torch_runs_on_intels_openmp_and_tcmalloc_with_the_same_results() -> None:
    if not cpu_runtime.iomp_path().is_file():
        pytest.fail(f"no {cpu_runtime.iomp_path()}: install the dev extra (intel-openmp)")
    preload = cpu_runtime.suggested_preload()
    if "tcmalloc" not in preload:
        pytest.fail("no tcmalloc: apt-get install libtcmalloc-minimal4 (.ci/run does)")
    plain, _ = probe(None)
    preloaded, stderr = probe(preload)
    assert preloaded["loaded"] == {"libiomp5": True, "tcmalloc": True} and preloaded["advised_ok"]
    assert "cpu_runtime" not in stderr and preloaded["threads"] == 2
    assert preloaded["sum"] == plain["sum"] == float((1 << 20) * ((1 << 20) - 1) // 2)
    assert preloaded["matmul"] == pytest.approx(plain["matmul"], rel=1e-5, abs=1e-5)
    assert preloaded.get("attention") == plain.get("attention")  # each task alone: the same bits on either runtime


ACTOR_PROBE = """
import json, os, ray
ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)

@ray.remote(num_cpus=1)
def maps():
    import torch
    from tandem.core import cpu_runtime
    torch.set_num_threads(1)
    (torch.randn(64, 64) @ torch.randn(64, 64)).sum().item()
    return {"loaded": cpu_runtime.loaded(), "preload": os.environ.get("LD_PRELOAD")}

from tandem.core import cpu_runtime
print(json.dumps({"driver": cpu_runtime.loaded(), "actor": ray.get(maps.remote(), timeout=180)}))
"""


@x86_linux
def test_ray_workers_of_a_node_started_with_the_preload_run_on_it() -> None:
    """What the chart's CPU pods do (ray.cpuPreload): LD_PRELOAD on the node's `ray start`, none in the driver."""
    pytest.importorskip("ray")
    from pools_harness import head_env
    from tandem.bench.local_cluster import start_ray_head

    preload = cpu_runtime.suggested_preload()
    if "tcmalloc" not in preload or "libiomp5" not in preload:
        pytest.fail("needs tcmalloc and intel-openmp: apt-get install libtcmalloc-minimal4; the dev extra")
    temp = tempfile.mkdtemp(prefix="ray")  # short: Ray's socket paths must fit in 107 bytes
    head, address = start_ray_head(temp, lambda a: head_env(a) | {"LD_PRELOAD": preload}, cpus=1)
    try:
        env = {k: v for k, v in head_env(address).items() if k != "LD_PRELOAD"} | {
            "PYTHONPATH": os.pathsep.join(sys.path)}
        done = subprocess.run([sys.executable, "-c", ACTOR_PROBE], capture_output=True, text=True, env=env,
                              timeout=300)
        # Ray's own abort puts its reason first and a long native stack after it: keep both ends.
        assert done.returncode == 0, done.stderr[:2000] + "\n...\n" + done.stderr[-1500:]
        result = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        head.terminate()
        head.wait(timeout=120)
        shutil.rmtree(temp, ignore_errors=True)
    assert result["driver"] == {"libiomp5": False, "tcmalloc": False}
    assert result["actor"] == {"loaded": {"libiomp5": True, "tcmalloc": True}, "preload": preload}


@x86_linux
def test_the_environment_to_run_again_in_and_where_there_is_none(tmp_path: Path, monkeypatch) -> None:
    """With TANDEM_PRELOAD=1 the `tandem` command runs itself again with the preload, never twice, never over an
    operator's LD_PRELOAD, not on a machine with an NVIDIA driver, not where nothing is installed; unasked, never."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    monkeypatch.setattr(cpu_runtime.sys, "prefix", str(tmp_path))
    monkeypatch.setattr(cpu_runtime, "TCMALLOC", (str(tmp_path / "missing.so"),))
    monkeypatch.setattr(cpu_runtime, "NVIDIA_DRIVER", tmp_path / "nvidia")
    env = {"PATH": "/bin", "TANDEM_PRELOAD": "1"}
    again = cpu_runtime.preload_environment(env)
    assert again == env | {"LD_PRELOAD": str(tmp_path / "lib" / "libiomp5.so")}
    assert cpu_runtime.preload_environment(again) is None  # the process run again goes on
    assert cpu_runtime.preload_environment(env | {"LD_PRELOAD": "/opt/jemalloc.so"}) is None
    assert cpu_runtime.preload_environment({"PATH": "/bin"}) is None
    assert cpu_runtime.preload_environment(env | {"TANDEM_PRELOAD": "0"}) is None
    (tmp_path / "nvidia").mkdir()
    assert cpu_runtime.preload_environment(env) is None
    (tmp_path / "nvidia").rmdir()
    (tmp_path / "lib" / "libiomp5.so").unlink()
    assert cpu_runtime.preload_environment(env) is None


def test_only_commands_that_run_models_here_run_again(monkeypatch) -> None:
    """A command that loads no model (a client, `keys`, remote `generate --address`) is not run twice."""
    from tandem.cli import main

    ran: list[dict] = []
    monkeypatch.setattr(main.os, "execve", lambda path, argv, env: ran.append(env))
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.setenv("TANDEM_PRELOAD", "1")
    expected = cpu_runtime.preload_environment(os.environ) is not None
    for words, again in ((["serve", "--in-process"], expected), (["generate", "hi"], expected),
                         (["pools", "start"], expected), (["bench"], expected), (["--version"], False),
                         (["generate", "hi", "--address", "h:1"], False), (["keys", "add"], False),
                         (["gateway"], False), (["models", "list"], False)):
        ran.clear()
        main.relaunch_preloaded(words)
        assert bool(ran) is again, words
        assert all("LD_PRELOAD" in env for env in ran)
