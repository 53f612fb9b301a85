"""Shared fixtures: one tiny random-weight model family, built once per test session."""

from __future__ import annotations

import fcntl
import os
import shutil
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch

from tandem.models.store import CALIBRATION_ENV

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# `tandem serve` and `tandem generate` keep measured costs in calibration.json under $TANDEM_HOME unless told
# otherwise: the servers and commands tests start calibrate every time instead (tests that keep costs name their own
# file), and leave no entry in the user's.
os.environ[CALIBRATION_ENV] = ""
if not torch.cuda.is_available():
    # Triton kernels (tests/test_triton_decode.py) run under Triton's interpreter where Triton is installed without a
    # GPU. Triton reads this when it defines a kernel, its own library's too: before any test imports it.
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tiny models gain nothing from intra-op threads, and two threads on two busy cores thrash.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def guards_checked(monkeypatch):
    """Compiled forwards that skip dynamo's guards (core.guardless) check them anyway in every test, and fail where
    the guards would have picked another graph than their shape class's."""
    from tandem.core.guardless import GuardlessForward

    monkeypatch.setattr(GuardlessForward, "check_guards", True)


@pytest.fixture(autouse=True)
def _torch_threads_kept():
    """A benchmark's main, called in a test, sets torch's threads for the process (its --threads); the next tests
    keep the one thread set above, which is also what inductor's compiled code and its cache are keyed by."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray on loopback for the whole run: starting Ray twice in a process is slow and flaky."""
    ray = pytest.importorskip("ray")
    # address="local": a Ray of its own even where this machine runs another (`ray start` leaves one for ray.init)
    ray.init(address="local", num_cpus=16, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             configure_logging=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                                       "TOKENIZERS_PARALLELISM": "false"}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    from tandem.models.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny"), seed=0)


@dataclass(frozen=True)
class ChangedModel:
    """A pulled model directory (with its manifest) whose weights file changed after the pull."""

    path: Path
    recorded: str  # model.safetensors' sha256 in the manifest
    actual: str  # its sha256 now

    @property
    def refusal(self) -> str:
        """How the loader refuses it (tandem.models.verify)."""
        return (f"model 'tiny-pulled': model.safetensors does not match its manifest (sha256 {self.actual}, "
                f"recorded {self.recorded}); it changed after it was pulled, so it is not loaded")


@pytest.fixture(scope="session")
def changed_model(tiny_dirs, tmp_path_factory) -> ChangedModel:
    """The tiny target as a pulled model (a manifest of its files' hashes), then one byte of its weights flipped."""
    from tandem.models.store import MANIFEST_NAME, Manifest
    from tandem.models.verify import digest_files

    path = tmp_path_factory.mktemp("changed") / "tiny-pulled"
    shutil.copytree(tiny_dirs.target, path)
    files = digest_files(path)
    manifest = Manifest(name="tiny-pulled", sha256="0" * 64, packages=(), version="0", size_bytes=0, files=files,
                        created=datetime.now(UTC).isoformat())
    (path / MANIFEST_NAME).write_text(manifest.to_json())
    weights = bytearray((path / "model.safetensors").read_bytes())
    weights[-1] ^= 0x01
    (path / "model.safetensors").write_bytes(bytes(weights))
    return ChangedModel(path, files["model.safetensors"].sha256, digest_files(path)["model.safetensors"].sha256)


@pytest.fixture(scope="session")
def tiny_models(tiny_dirs):
    """(target, draft, draft_random) as LoadedModel, float32 on CPU."""
    from tandem.models.loader import load_model

    def load(path: Path):
        return load_model(str(path), device=torch.device("cpu"), dtype=torch.float32, progress=False)

    return load(tiny_dirs.target), load(tiny_dirs.draft), load(tiny_dirs.draft_random)


# Modules that start Ray, by the worker group they share under pytest-xdist (`--dist loadgroup`): tests of one module
# keep their order and fixtures; the in-process Ray tests share one group (the session's `ray_session`), and each
# group of pools tests, which start their own Ray heads on free ports, may run beside another one.
RAY_GROUPS = {
    "ray": ("test_calibration_file", "test_canary_e2e", "test_cli_conventions", "test_gateway_cli", "test_hardening",
            "test_logprobs", "test_openai_api_http", "test_openai_api_lifecycle", "test_openai_api_outputs",
            "test_prompt_logprobs", "test_ray_workers_drafting", "test_ray_workers_targets",
            "test_ray_workers_tensor_parallel", "test_security_keys", "test_security_tenants", "test_security_tls",
            "test_serve_cluster", "test_shared_kv", "test_telemetry_cli", "test_telemetry_cluster"),
    "pools": ("test_pools", "test_ray_client"),
    "pools-tp-chaos": ("test_pools_tp", "test_pools_chaos"),
    "pools-auth": ("test_pools_calibration", "test_ray_auth", "test_pools_lifecycle"),
}
RAY_GROUP_OF = {module: group for group, modules in RAY_GROUPS.items() for module in modules}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        group = RAY_GROUP_OF.get(item.module.__name__.rpartition(".")[2])
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(autouse=True)
def _alone_when_marked(request, tmp_path_factory):
    """A test marked `alone` bounds wall-clock gaps (a stream's, a call's); on two cores another xdist worker's test
    can hold the CPU for a second, so such a test waits until no other test runs, and holds the others off while it
    runs: every test takes a shared lock on one file beside the workers' temporary directories, `alone` ones an
    exclusive one."""
    path = tmp_path_factory.getbasetemp().parent / "tests-running.lock"
    alone = request.node.get_closest_marker("alone") is not None
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="module")
def server(tiny_models):
    """A gateway over the tiny pair in this process, gRPC and the HTTP API on free ports, prompts up to 2048 tokens:
    the one the OpenAI API test modules share (a module that needs another defines its own `server`)."""
    from gateway_harness import tiny_http_server

    yield from tiny_http_server(tiny_models, max_prompt_tokens=2048)


@pytest.fixture(scope="module")
def sdk(server):
    """The openai SDK's client of `server` (no retries)."""
    from gateway_harness import openai_sdk

    return openai_sdk(server)
