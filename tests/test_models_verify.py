"""A pulled model directory is re-hashed against its manifest at every load (tandem.models.verify).

The pulled directory is built as models_pull_harness builds one: real pip over hand-made wheels, a tiny real GGUF,
the real conversion; once per session, then copied into each test's own store.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from models_pull_harness import Fixture, make_fixture, write_tiny_gguf
from tandem.errors import IntegrityError
from tandem.models import registry
from tandem.models.loader import load_model, load_pair
from tandem.models.pull import pull
from tandem.models.store import ModelStore
from tandem.models.verify import verify_model_dir

CPU = torch.device("cpu")


@pytest.fixture(scope="session")
def pulled(tmp_path_factory: pytest.TempPathFactory) -> Fixture:
    root = tmp_path_factory.mktemp("pulled")
    write_tiny_gguf(root / "tiny.gguf")
    fx = make_fixture(root, (root / "tiny.gguf").read_bytes(), tag="v")
    pull(fx.entry, store=fx.store, pip_args=fx.pip_args, progress=False)
    return fx


@pytest.fixture
def store(pulled: Fixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModelStore:
    """This test's own copy of the pulled store, as TANDEM_HOME, with the fixture model in the registry."""
    shutil.copytree(pulled.store.root, tmp_path / "home")
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    monkeypatch.setitem(registry.REGISTRY, pulled.entry.name, pulled.entry)
    return ModelStore(tmp_path / "home")


@pytest.fixture
def hf_dir(store: ModelStore, pulled: Fixture) -> Path:
    return store.hf_dir(pulled.entry.name)


def load(spec: str | Path):
    return load_model(str(spec), device=CPU, dtype=torch.float32, progress=False)


def flip_one_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def refusal(spec: str | Path) -> str:
    with pytest.raises(IntegrityError) as caught:
        load(spec)
    return str(caught.value)


def test_intact_pulled_directory_loads(hf_dir: Path, pulled: Fixture) -> None:
    assert verify_model_dir(hf_dir) is True
    assert load(pulled.entry.name).model.config.vocab_size == 262  # by registry name
    assert load(hf_dir).path == str(hf_dir)  # by path


def test_one_flipped_byte_refuses_to_load(hf_dir: Path, pulled: Fixture) -> None:
    weights = hf_dir / "model.safetensors"
    flip_one_byte(weights, weights.stat().st_size - 5)  # in the tensor data: same size, other content
    for spec in (pulled.entry.name, hf_dir):
        message = refusal(spec)
        assert "model.safetensors does not match its manifest" in message
        assert f"model {pulled.entry.name!r}" in message
        assert str(hf_dir) not in message  # clients may see the error: no server paths in it
        assert f"tandem models pull --force {pulled.entry.name}" in message


def test_a_pairs_files_are_checked_beside_the_loading_and_refused_when_changed(hf_dir: Path, pulled: Fixture,
                                                                              tmp_path: Path, caplog) -> None:
    target = tmp_path / "target"
    shutil.copytree(hf_dir, target)  # a directory with its manifest, loaded by path
    with caplog.at_level(logging.INFO, logger="tandem.models.verify"):
        load_pair(pulled.entry.name, str(target), device=CPU, dtype=torch.float32, progress=False)
    checked = [record.threadName.split("_")[0] for record in caplog.records if "match its manifest" in record.message]
    assert checked == ["verify", "verify"]  # the draft's while the loading thread imports, the target's as it loads
    flip_one_byte(target / "model.safetensors", (target / "model.safetensors").stat().st_size - 5)
    for pair in ((pulled.entry.name, target), (target, hf_dir)):  # the changed directory as the target, as the draft
        with pytest.raises(IntegrityError, match=r"model\.safetensors does not match its manifest"):
            load_pair(*map(str, pair), device=CPU, dtype=torch.float32, progress=False)


def test_missing_file_refuses_to_load(hf_dir: Path, pulled: Fixture) -> None:
    (hf_dir / "tokenizer.json").unlink()
    assert "tokenizer.json is missing" in refusal(pulled.entry.name)


def test_truncated_file_is_refused_without_hashing(hf_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.models import verify

    weights = hf_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1])
    monkeypatch.setattr(verify, "file_sha256", lambda *a: pytest.fail("hashed a file whose size already differs"))
    assert "model.safetensors has" in refusal(hf_dir)


def test_added_file_is_refused(hf_dir: Path) -> None:
    (hf_dir / "added_tokens.json").write_text("{}")  # would change the tokenizer from_pretrained builds
    assert "added_tokens.json is not in its manifest" in refusal(hf_dir)


def test_pulled_directory_without_its_manifest_is_refused(hf_dir: Path, pulled: Fixture) -> None:
    (hf_dir / "tandem.json").unlink()
    message = refusal(hf_dir)
    assert "tandem.json is missing" in message and f"model {pulled.entry.name!r}" in message


def test_manifest_pointing_outside_the_directory_is_refused(hf_dir: Path) -> None:
    manifest = json.loads((hf_dir / "tandem.json").read_text())
    manifest["files"]["../../../etc/hostname"] = {"size": 1, "sha256": "0" * 64}
    (hf_dir / "tandem.json").write_text(json.dumps(manifest))
    assert "a path outside the model directory" in refusal(hf_dir)


def test_unreadable_manifest_is_refused(hf_dir: Path) -> None:
    (hf_dir / "tandem.json").write_text("{not json")
    assert "tandem.json cannot be read" in refusal(hf_dir)


def test_manifest_from_before_file_hashes_loads_with_a_warning(
    hf_dir: Path, pulled: Fixture, caplog: pytest.LogCaptureFixture
) -> None:
    manifest = json.loads((hf_dir / "tandem.json").read_text())
    del manifest["files"]
    (hf_dir / "tandem.json").write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING, logger="tandem.models.verify"):
        assert verify_model_dir(hf_dir) is False
        load(pulled.entry.name)
    assert "predates per-file hashes" in caplog.text and "pull --force" in caplog.text
    from tandem.cli.main import main

    assert main(["models", "verify", pulled.entry.name]) == 1  # an explicit check does not pass what it cannot check


def test_plain_model_directory_has_nothing_to_verify(tiny_dirs) -> None:
    assert verify_model_dir(tiny_dirs.target) is False  # no manifest, not in a store: loads as before
    assert load(tiny_dirs.target).model is not None


def test_models_verify_cli(hf_dir: Path, pulled: Fixture, capsys: pytest.CaptureFixture) -> None:
    from tandem.cli.main import main

    assert main(["models", "verify"]) == 0
    assert f"{pulled.entry.name}\tverified" in capsys.readouterr().out
    flip_one_byte(hf_dir / "config.json", 3)
    assert main(["models", "verify", pulled.entry.name]) == 1
    out = capsys.readouterr().out
    assert f"{pulled.entry.name}\tFAILED" in out and "config.json" in out
