"""What the pull test modules (tests/test_models_pull.py, tests/test_models_store.py) share: a tiny real GGUF written
with gguf-py, hand-built wheels that carry it in two parts, a registry entry pinned to them and a store to pull into
(make_fixture), and the session's GGUF bytes and each test's fixture built from them (pytest fixtures, imported by
name)."""

from __future__ import annotations

import base64
import hashlib
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tandem.models.registry import RegistryEntry
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


# A module imports the fixtures by these names (pytest finds a fixture by the name it is given; the import keeps ruff
# from reading the test arguments as redefinitions).
@pytest.fixture(scope="session", name="gguf_bytes")
def gguf_bytes_fixture(tmp_path_factory: pytest.TempPathFactory) -> bytes:
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


@pytest.fixture(name="fx")
def fx_fixture(tmp_path: Path, gguf_bytes: bytes) -> Fixture:
    return make_fixture(tmp_path, gguf_bytes, tag="a")
