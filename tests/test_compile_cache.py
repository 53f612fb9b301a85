"""torch.compile's cache lives under the model store (models.store.use_compile_cache), so a restarted pod, or every
replica on a shared claim, starts from compiled code; a directory the user set is kept."""

from __future__ import annotations

import os

import torch
from torch._inductor.runtime.cache_dir_utils import cache_dir

from tandem.core.config import EngineConfig
from tandem.engines.local import build_engine
from tandem.models.loader import load_model
from tandem.workers.worker_base import WorkerConfig, load_runner

CACHE = "TORCHINDUCTOR_CACHE_DIR"


def test_engines_and_workers_keep_compiled_code_under_the_model_store(tiny_dirs, tmp_path, monkeypatch) -> None:
    """In the order a server runs: load (from_pretrained resolves inductor's cache directory, and the first
    resolution sticks for the process), then build and warm up."""
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    monkeypatch.delenv(CACHE, raising=False)
    loaded = load_model(str(tiny_dirs.target), device=torch.device("cpu"), dtype=torch.float32, progress=False)
    assert cache_dir() == str(tmp_path / "compile")
    build_engine(loaded, None, EngineConfig(calibrate=False))
    assert os.environ[CACHE] == str(tmp_path / "compile")
    monkeypatch.delenv(CACHE)
    load_runner(WorkerConfig(model=str(tiny_dirs.draft), device="cpu", dtype="float32"))
    assert cache_dir() == str(tmp_path / "compile")


def test_the_store_wins_over_the_default_an_early_import_wrote(tiny_dirs, tmp_path, monkeypatch) -> None:
    """Importing transformers (which tandem's runner does) asks inductor for its directory, and inductor writes its
    default into the environment: a server that imported the runner before loading kept compiling under /tmp."""
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    monkeypatch.delenv(CACHE, raising=False)
    cache_dir()  # what the import does
    assert os.environ[CACHE] != str(tmp_path / "compile")
    load_model(str(tiny_dirs.target), device=torch.device("cpu"), dtype=torch.float32, progress=False)
    assert cache_dir() == str(tmp_path / "compile")


def test_a_cache_directory_the_user_set_is_kept(tiny_dirs, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv(CACHE, str(tmp_path / "mine"))
    load_runner(WorkerConfig(model=str(tiny_dirs.target), device="cpu", dtype="float32"))
    assert os.environ[CACHE] == str(tmp_path / "mine")
