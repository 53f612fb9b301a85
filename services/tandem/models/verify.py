"""Re-check a pulled model directory against the per-file sha256 its manifest recorded when it was pulled.

`tandem models pull` verifies the GGUF it assembles, but what the server loads is the converted hf/ folder, which sits
in a cache that outlives the pull (a shared volume, a node's disk). The loader re-hashes every file before each load
so that a file changed, truncated, added or removed since the pull is refused instead of served.

What this does not do: the manifest lives in the same folder, so whoever can write the folder can write a matching
manifest too. This catches corruption and a partial tamper (one file swapped); against a writer of the whole cache the
defence is keeping it read-only to the servers. The check also runs before, not while, the files are loaded.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path, PurePosixPath
from typing import NoReturn

from tqdm.auto import tqdm

from tandem.errors import IntegrityError
from tandem.models.store import HF_DIR, MANIFEST_NAME, FileDigest, Manifest, ModelStore, read_manifest

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
PROGRESS_MIN_BYTES = 256 << 20  # a progress bar only where hashing takes noticeable time


def file_sha256(path: Path, bar: tqdm | None = None) -> str:
    """The sha256 of a file, read in chunks (model files are GiB), advancing `bar` by the bytes read."""
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        while chunk := source.read(CHUNK_BYTES):
            digest.update(chunk)
            if bar is not None:
                bar.update(len(chunk))
    return digest.hexdigest()


def listed_files(directory: Path) -> list[str]:
    """Every file under `directory` but its manifest, as sorted relative POSIX paths."""
    return sorted(
        rel for path in directory.rglob("*") if path.is_file()
        if (rel := path.relative_to(directory).as_posix()) != MANIFEST_NAME
    )


def digest_files(directory: Path) -> dict[str, FileDigest]:
    """What a pull records in the manifest: the size and sha256 of each file of `directory`."""
    return {rel: FileDigest(size=(directory / rel).stat().st_size, sha256=file_sha256(directory / rel))
            for rel in listed_files(directory)}


def _safe(rel: str) -> bool:
    """A manifest entry names a file inside the directory (a rewritten one could point anywhere)."""
    path = PurePosixPath(rel)
    return bool(rel) and not path.is_absolute() and ".." not in path.parts and "\\" not in rel


def verify_model_dir(directory: Path, *, name: str | None = None, progress: bool = False,
                     store: ModelStore | None = None) -> bool:
    """Refuse (IntegrityError) a pulled model directory whose files differ from its manifest.

    Returns True when every file was checked, False when there was nothing to check against: a plain Hugging Face
    directory (no manifest, not in a tandem store), or a manifest from before per-file hashes (warned about).
    Errors name the model and the file relative to the directory (clients may see them); the full path is logged.
    """
    store = store if store is not None else ModelStore()
    # A pulled model is named by its folder in the store (models/<name>/hf) until its manifest says otherwise.
    fallback = name or (directory.resolve().parent.name if directory.name == HF_DIR else directory.name)
    if not (directory / MANIFEST_NAME).exists():
        if store.owns(directory):
            _refuse(directory, fallback, MANIFEST_NAME,
                    "is missing: the directory is a pulled model's, and a pull always writes one")
        return False
    manifest = read_manifest(directory)
    if manifest is None:
        _refuse(directory, fallback, MANIFEST_NAME, "cannot be read")
    display = name or manifest.name
    if manifest.files is None:
        log.warning("model %s (%s): its manifest predates per-file hashes, so its files are not verified; "
                    "`tandem models pull --force %s` pulls it again with them", display, directory, manifest.name)
        return False
    _check(directory, display, manifest, progress)
    return True


def _check(directory: Path, display: str, manifest: Manifest, progress: bool) -> None:
    files = manifest.files or {}
    for rel, expected in files.items():  # cheap checks first: a missing or truncated file needs no hashing
        if not _safe(rel):
            _refuse(directory, display, MANIFEST_NAME, f"lists {rel!r}, a path outside the model directory")
        path = directory / rel
        if not path.is_file():
            _refuse(directory, display, rel, "is missing (its manifest lists it)")
        if (size := path.stat().st_size) != expected.size:
            _refuse(directory, display, rel, f"has {size} bytes, its manifest recorded {expected.size}")
    # A file the pull did not write can change what from_pretrained loads (an index, an added-tokens file).
    if extra := [rel for rel in listed_files(directory) if rel not in files]:
        _refuse(directory, display, extra[0], "is not in its manifest (the pull did not write it)")
    total = sum(entry.size for entry in files.values())
    started = time.monotonic()
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"verifying {display}", leave=False,
              disable=not progress or total < PROGRESS_MIN_BYTES) as bar:
        for rel, expected in files.items():
            if (actual := file_sha256(directory / rel, bar)) != expected.sha256:
                _refuse(directory, display, rel, f"does not match its manifest (sha256 {actual}, recorded "
                        f"{expected.sha256})")
    log.info("model %s: %d files (%.2f GiB) match its manifest, checked in %.1fs", display, len(files),
             total / (1 << 30), time.monotonic() - started)


def _refuse(directory: Path, display: str, rel: str, reason: str) -> NoReturn:
    log.warning("%s: %s", directory / rel, reason)  # the operator's log may name the path; the error does not
    raise IntegrityError(f"model {display!r}: {rel} {reason}; it changed after it was pulled, so it is not loaded "
                         f"(`tandem models pull --force {display}` pulls it again)")
