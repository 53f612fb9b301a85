"""Where a model argument's files are, read from the argument alone: a local Hugging Face directory, a GGUF file,
or a hub id (None here: the hub answers later). Torch-free, so a command refuses a model argument that no load could
use before it imports anything heavy or starts anything."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.errors import ModelNotFound
from tandem.models.hub import hub_ref, looks_local
from tandem.models.registry import PAIRS, REGISTRY, known_names

ACCEPTED_FORMS = (
    "a registry name ({names}), a Hugging Face model directory (with config.json), "
    "a .gguf file, or a Hugging Face hub id pinned to a commit, org/name@<40-hex commit> (needs a reachable hub "
    "or a local hub cache)"
)


@dataclass(frozen=True, slots=True)
class Source:
    path: str
    gguf_file: str | None = None
    local_files_only: bool = False
    revision: str | None = None  # a hub id's commit; from_pretrained must be given it for model and tokenizer

    def hub_kwargs(self) -> dict[str, Any]:
        """What from_pretrained needs to find these files: offline or not, the GGUF file, the hub commit."""
        kwargs: dict[str, Any] = {"local_files_only": self.local_files_only}
        if self.gguf_file is not None:
            kwargs["gguf_file"] = self.gguf_file
        if self.revision is not None:
            kwargs["revision"] = self.revision
        return kwargs


def not_found(spec: str, reason: str) -> ModelNotFound:
    forms = ACCEPTED_FORMS.format(names=", ".join(known_names()))
    return ModelNotFound(f"model {spec!r}: {reason}; give {forms}")


def local_source(spec: str) -> Source | None:
    """A local model directory or GGUF file; None for a hub id; ModelNotFound for anything else (not a registry
    name: the caller has looked)."""
    if spec in PAIRS:
        draft, target = PAIRS[spec]
        raise not_found(spec, f"this names a draft/target pair; use {draft!r} or {target!r}")
    path = Path(spec).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return Source(str(path))
        raise not_found(spec, f"directory {path} has no config.json")
    if path.is_file():
        if path.suffix == ".gguf":
            return Source(str(path.parent), gguf_file=path.name)
        raise not_found(spec, f"{path} is a file but not a .gguf file")
    if looks_local(spec):
        raise not_found(spec, "no such file or directory")
    if hub_ref(spec) is None:
        raise not_found(spec, "not a registry name, a local path or a hub id")
    return None


def check_spec(spec: str) -> None:
    """Refuse (ModelNotFound) a model argument that no load could use, as loader.resolve would, but without
    pulling, hashing or asking a hub: a pair's alias, a path that is not a model, a name of no accepted form. Commands
    call it before they start anything, so a mistyped path fails at once rather than after Ray and the gateway are
    up."""
    if spec not in REGISTRY:
        local_source(spec)
