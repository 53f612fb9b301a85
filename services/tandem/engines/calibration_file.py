"""Measured costs kept in a file across restarts (`tandem serve --calibration-file`), keyed by what they depend on.

Calibration times the pair's forwards before a server turns ready (core.calibration): seconds on a GPU, minutes on a
CPU (the real pair on CPU-B's 2 AVX2 cores: `tandem serve` ready after 198-221 s in float32 at --max-batch 8, 821 s
in bf16 at 16; 63-68 and 33 s reusing the file's costs). Those timings
depend on the machine, the models, how they run and the engine's settings, not on the traffic, so a restart with all
of these unchanged reuses them. The key holds every build option and engine setting (a changed one only costs a
calibration), the models' identities, this host's CPU, cores and GPUs, the versions of torch and transformers and a
digest of tandem's own code (a new runner prices differently). In service the cost model keeps adapting to the
forwards it times, as it does after a fresh calibration.

The key describes the host this process runs on: over a joined Ray cluster (--ray-address) the workers' hosts may
differ, and a file kept there goes stale when they change without the address or options changing.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Callable
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.core.costs import CostModel
from tandem.engines.options import Arm, BuildOptions, ClusterOptions

if TYPE_CHECKING:
    from tandem.engines.backend import Backend

log = logging.getLogger(__name__)

FORMAT = 1
KEPT = 16  # entries a file holds (one per setup), the least recently measured dropped first
SECRET_OPTIONS = ("ray_token_file",)  # where a secret lives says nothing about costs


def build_reusing(options: BuildOptions,
                  build: Callable[[BuildOptions], dict[str, Backend]]) -> dict[str, Backend]:
    """`build(options)`, where every arm whose costs options.calibration_file holds starts from them instead of
    calibrating, and every arm that calibrated has its costs stored there."""
    keys = {arm.name: key(options, arm) for arm in options.arms if calibrates(arm)}
    reused = {name: costs for name, wanted in keys.items()
              if (costs := load(options.calibration_file, wanted)) is not None}
    arms = tuple(dataclasses.replace(arm, config=dataclasses.replace(arm.config, calibrate=False))
                 if arm.name in reused else arm for arm in options.arms)
    backends = build(dataclasses.replace(options, arms=arms))
    for name, wanted in keys.items():
        costs = backends[name].engine.costs  # an arm's lanes share it (engines.backend.engine_lanes)
        if name in reused:
            costs.adopt(reused[name])
        elif costs.calibrated:
            save(options.calibration_file, wanted, costs)
    return backends


def calibrates(arm: Arm) -> bool:
    """Whether building `arm` runs calibration (its engine has a drafter: EngineConfig.calibrates)."""
    return bool(arm.draft) and arm.config.calibrates


def key(options: BuildOptions, arm: Arm) -> dict:
    """What `arm`'s measured costs depend on, as JSON values."""
    placement = {name: value for name, value in dataclasses.asdict(options.placement).items()
                 if name not in SECRET_OPTIONS}
    if isinstance(options.placement, ClusterOptions) and not placement["ray_address"]:
        placement["ray_address"] = os.environ.get("RAY_ADDRESS", "")
    facts = {"target": options.target, "target_identity": model_identity(options.target), "draft": arm.draft,
             "draft_identity": model_identity(arm.draft), "engine": dataclasses.asdict(arm.config),
             "placement": {"kind": type(options.placement).__name__, **placement}, "lanes": options.lanes,
             "host": host_facts(), "versions": versions()}
    return json.loads(json.dumps(facts, sort_keys=True, default=str))


def model_identity(spec: str) -> str:
    """A registry name or a hub id pinned to a commit names its weights; a local directory is known by its files."""
    path = Path(spec).expanduser()
    if not spec or not path.exists():
        return spec
    files = sorted(p for p in (path.rglob("*") if path.is_dir() else [path]) if p.is_file())
    digest = hashlib.sha256()
    for file in files:
        stat = file.stat()
        digest.update(f"{file.relative_to(path.parent)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return f"files:{digest.hexdigest()[:32]}"


@cache
def host_facts() -> dict:
    """This host's CPU model, the cores this process may use, and its NVIDIA GPUs (read from the driver's /proc
    files: asking torch would create a CUDA context in the gateway)."""
    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), platform.processor())
    gpus = sorted(line.split(":", 1)[1].strip() for info in Path("/proc/driver/nvidia/gpus").glob("*/information")
                  for line in _read(info).splitlines() if line.startswith("Model:"))
    return {"machine": platform.machine(), "cpu": cpu, "cores": len(os.sched_getaffinity(0)), "gpus": gpus}


@cache
def versions() -> dict:
    """torch's and transformers' versions, and a digest of tandem's own source files."""
    package = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for source in sorted(package.rglob("*.py")):
        digest.update(source.relative_to(package).as_posix().encode() + b"\0" + source.read_bytes())
    return {"torch": _version("torch"), "transformers": _version("transformers"),
            "tandem_code": digest.hexdigest()[:32]}


def load(path: str, wanted: dict) -> CostModel | None:
    """The costs stored under `wanted`, or None (logging why: no file, an unreadable one, or what differs)."""
    entries = _entries(path)
    for entry in entries:
        if entry.get("key") == wanted:
            try:
                costs = CostModel.from_dict(entry["costs"])
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                log.warning("calibration: ignoring %s's entry for this setup (%r); calibrating", path, exc)
                return None
            log.info("calibration: reusing the costs measured %s (%s)", entry.get("measured", "?"), path)
            return costs
    if entries:
        changed = _differences(entries[-1].get("key", {}), wanted)
        log.info("calibration: %s holds no costs for this setup (the latest differs in %s); calibrating", path,
                 ", ".join(changed[:8]))
    return None


def save(path: str, wanted: dict, costs: CostModel) -> None:
    """Store `costs` under `wanted` (replacing an entry with that key), written whole or not at all."""
    entries = [entry for entry in _entries(path) if entry.get("key") != wanted]
    measured = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    entries = [*entries, {"key": wanted, "measured": measured, "costs": costs.to_dict()}][-KEPT:]
    target = Path(path).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=target.parent, prefix=f".{target.name}.", delete=False) as out:
        json.dump({"format": FORMAT, "entries": entries}, out, indent=1)
    os.replace(out.name, target)
    log.info("calibration: costs stored in %s", path)


def _differences(stored, wanted, where: str = "") -> list[str]:
    """The dotted names at which two keys differ."""
    if isinstance(stored, dict) and isinstance(wanted, dict):
        return [name for field in sorted({*stored, *wanted})
                for name in _differences(stored.get(field), wanted.get(field), f"{where}.{field}" if where else field)]
    return [] if stored == wanted else [where]


def _entries(path: str) -> list[dict]:
    file = Path(path).expanduser()
    if not file.exists():
        return []
    try:
        stored = json.loads(file.read_text())
        if stored.get("format") != FORMAT or not isinstance(stored.get("entries"), list):
            raise ValueError(f"not a format-{FORMAT} calibration file")
        return [entry for entry in stored["entries"] if isinstance(entry, dict)]
    except (OSError, ValueError, AttributeError) as exc:
        log.warning("calibration: ignoring %s (%s); it is rewritten after calibrating", path, exc)
        return []


def _read(path: str | Path) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return ""
