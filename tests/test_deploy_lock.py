"""The image installs from a hashed lock (deploy/requirements.lock, scripts/lock_deps.sh): static checks, no network.

Regenerating the lock needs PyPI; these only check that the committed lock still covers pyproject.toml, pins every
package to one version with its hashes, and that deploy/Dockerfile installs nothing past it.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "deploy" / "requirements.lock"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
ENTRY = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)((?:\s*\\\n\s+--hash=sha256:[0-9a-f]{64})+)", re.M)


def locked() -> dict[str, tuple[Version, int]]:
    """{canonical name: (pinned version, number of sha256 hashes)}."""
    entries = {canonicalize_name(name): (Version(version), hashes.count("--hash=sha256:"))
               for name, version, hashes in ENTRY.findall(LOCK.read_text())}
    assert entries, "no entries parsed from the lock"
    return entries


def requirements(*groups: list[str]) -> list[Requirement]:
    """Each group's requirements, less tandem's own extras (`tandem[gateway]` in server: its lines are a group)."""
    return [Requirement(line) for group in groups for line in group if Requirement(line).name != "tandem"]


def test_every_line_of_the_lock_is_an_exact_pin_with_hashes() -> None:
    text = LOCK.read_text()
    starts = [line for line in text.splitlines() if line and not line.startswith((" ", "#"))]
    assert len(starts) == len(locked()), "a lock line that is not `name==version` followed by its hashes"
    assert not any(line.startswith(("-e", "--")) or "://" in line or " @ " in line for line in starts)  # no URLs
    assert text.splitlines()[1] == "#    scripts/lock_deps.sh", "the lock is scripts/lock_deps.sh's output"


@pytest.mark.parametrize("requirement", requirements(
    PYPROJECT["project"]["dependencies"], PYPROJECT["project"]["optional-dependencies"]["server"],
    PYPROJECT["project"]["optional-dependencies"]["gateway"],
    PYPROJECT["project"]["optional-dependencies"]["cpu"], PYPROJECT["build-system"]["requires"], ["ray[default]"],
), ids=str)
def test_pyproject_requirement_is_pinned_and_hashed(requirement: Requirement) -> None:
    entries = locked()
    name = canonicalize_name(requirement.name)
    assert name in entries, f"{requirement} is not in {LOCK.name}: run scripts/lock_deps.sh"
    version, hashes = entries[name]
    assert hashes >= 1
    assert requirement.specifier.contains(version, prereleases=True), \
        f"{LOCK.name} pins {name}=={version}, outside pyproject's {requirement}: run scripts/lock_deps.sh"


def test_torch_pin_is_the_one_the_image_checks() -> None:
    [torch] = [r for r in requirements(PYPROJECT["project"]["optional-dependencies"]["server"]) if r.name == "torch"]
    pinned = str(next(iter(torch.specifier)).version)
    assert locked()["torch"][0] == Version(pinned)
    args = dict(re.findall(r"^ARG (\w+)=(.*)$", DOCKERFILE.read_text(), re.M))
    assert args["TORCH_VERSION"] == pinned and args["TORCH_VARIANT"] == "cu130"
    # PyPI's Linux x86_64 torch is the CUDA 13.0 build: its runtime wheels are locked with it.
    assert {"nvidia-cuda-runtime", "triton"} <= set(locked())


def test_dockerfile_installs_only_from_the_lock() -> None:
    text = DOCKERFILE.read_text()
    joined = text.replace("\\\n", " ")
    installs = [found.strip() for found in re.findall(r"pip install[^&\n]*", joined)]
    assert installs == [
        'pip install --no-cache-dir --require-hashes --no-deps --only-binary=:all: -r "${lock}"',
        "pip install --no-cache-dir --no-deps --no-build-isolation .",
    ]
    assert "lock=deploy/requirements.lock" in joined and "pip check" in joined
    assert "COPY deploy/requirements*.lock ./deploy/" in text
    assert "!deploy/requirements*.lock" in (ROOT / "deploy" / "Dockerfile.dockerignore").read_text()


def test_lock_script_resolves_for_the_image() -> None:
    script = (ROOT / "scripts" / "lock_deps.sh").read_text()
    python = re.search(r"^FROM python:(\d+\.\d+)-slim$", DOCKERFILE.read_text(), re.M).group(1)
    assert f"PYTHON_VERSION={python}\n" in script and "PLATFORM=x86_64-manylinux" in script
    assert "--generate-hashes" in script and "--extra server" in script
    assert "RAY_IMAGE_REQUIREMENT='ray[default]'" in script
