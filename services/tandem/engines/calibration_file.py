"""Measured costs kept in a file across restarts (`tandem serve`: by default calibration.json under $TANDEM_HOME,
models.store.default_calibration_file; --calibration-file PATH elsewhere, '' for none), keyed by what they depend on.

Calibration times the pair's forwards before a server turns ready (core.calibration): seconds on a GPU, minutes on a
CPU (the real pair on CPU-B's 2 AVX2 cores: `tandem serve` ready after 155-166 s in float32 at --max-batch 8, 54-57 s
reusing the file's costs; docs/performance.md, "Start-up: calibration"). Those timings depend on the
machine, the models, how they run and the engine's settings, not on the traffic, so a restart with all of these
unchanged reuses them. The key holds every build option and engine setting (a changed one only costs a
calibration), the models' identities, the hosts the models run on (each pool worker's CPU, cores, GPUs and torch
threads, as it reports them once started; this process's for models loaded here), the versions of torch and
transformers and a digest of tandem's own code (a new runner prices differently). In service the cost model keeps
adapting to the forwards it times, as it does after a fresh calibration.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.core.costs import CostModel
from tandem.engines.options import Arm, BuildOptions
from tandem.hostinfo import host_facts

if TYPE_CHECKING:
    from tandem.engines.backend import Backend

log = logging.getLogger(__name__)

FORMAT = 1
KEPT = 16  # entries a file holds (one per setup), the least recently measured dropped first
SECRET_OPTIONS = ("ray_token_file",)  # where a secret lives says nothing about costs
INFO_TIMEOUT_S = 60.0  # how long the workers, just started and idle, may take to say what they run on


def build_reusing(options: BuildOptions,
                  build: Callable[[BuildOptions], dict[str, Backend]]) -> dict[str, Backend]:
    """`build(options)` without calibrating; then each arm that would have calibrated starts from the costs
    options.calibration_file holds for it, or calibrates and stores its costs there. The key is built once the
    workers are up, from what they report of their hosts."""
    calibrating = {arm.name for arm in options.arms if calibrates(arm)}
    arms = tuple(dataclasses.replace(arm, config=dataclasses.replace(arm.config, calibrate=False))
                 if arm.name in calibrating else arm for arm in options.arms)
    backends = build(dataclasses.replace(options, arms=arms))
    for arm in options.arms:
        engine = backends[arm.name].engine  # an arm's lanes share its costs (engines.backend.engine_lanes)
        if arm.name in calibrating:
            reuse_or_calibrate(options.calibration_file, options, arm, engine)
    return backends


def reuse_or_calibrate(path: str, options: BuildOptions, arm: Arm, engine) -> None:
    """Start `engine`, built for `arm` without calibrating, from the costs `path` holds for that setup, or calibrate
    it and store its costs there."""
    wanted = key(options, arm, worker_facts(engine))
    stored = load(path, wanted)
    if stored is not None:
        engine.costs.adopt(stored)
        return
    engine.calibrate()
    if engine.costs.calibrated or (engine.drafter is None and engine.costs.batched):  # the target's alone
        save(path, wanted, engine.costs)


def worker_facts(engine) -> list[dict]:
    """The hosts and torch threads the engine's models run on: each pool worker's (the distinct ones), or this
    process's for models loaded here."""
    fanout = sys.modules.get("tandem.workers.fanout")  # unimported, no side is a pool client: no need to import Ray
    actors = [actor for side in (engine.verifier, engine.drafter) if fanout and isinstance(side, fanout.RayPoolClient)
              for actor in side.actors()]
    if not actors:
        return [{"host": host_facts(), "threads": None}]
    import ray

    infos = ray.get([actor.info.remote() for actor in actors], timeout=INFO_TIMEOUT_S)
    seen = {json.dumps({"host": info.get("host"), "threads": info.get("threads")}, sort_keys=True) for info in infos}
    return [json.loads(worker) for worker in sorted(seen)]


def calibrates(arm: Arm) -> bool:
    """Whether building `arm` runs calibration (EngineConfig.calibrates: with a drafter where it has a draft model)."""
    return arm.config.calibrates(bool(arm.draft))


def key(options: BuildOptions, arm: Arm, machines: list[dict]) -> dict:
    """What `arm`'s measured costs depend on, as JSON values; `machines`: what its models run on (worker_facts)."""
    placement = {name: value for name, value in dataclasses.asdict(options.placement).items()
                 if name not in SECRET_OPTIONS}
    facts = {"target": options.target, "target_identity": model_identity(options.target), "draft": arm.draft,
             "draft_identity": model_identity(arm.draft), "engine": dataclasses.asdict(arm.config),
             "placement": {"kind": type(options.placement).__name__, **placement}, "lanes": options.lanes,
             "workers": machines, "versions": versions()}
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


# Environment settings that choose which kernels a CPU forward runs (core.bf16_linear, core.cpu_attention): costs
# measured under one are not another's. Workers that tandem serve starts inherit its environment.
KERNEL_SETTINGS = ("TANDEM_CPU_LINEAR", "TANDEM_CPU_ATTENTION")


@cache
def versions() -> dict:
    """torch's and transformers' versions, a digest of tandem's own source files (its kernels' C++ included), and the
    kernel settings in the environment."""
    package = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for source in sorted([*package.rglob("*.py"), *package.rglob("*.cpp")]):
        digest.update(source.relative_to(package).as_posix().encode() + b"\0" + source.read_bytes())
    return {"torch": _version("torch"), "transformers": _version("transformers"),
            "tandem_code": digest.hexdigest()[:32],
            "kernel_settings": {name: os.environ.get(name, "") for name in KERNEL_SETTINGS}}


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
    """Store `costs` under `wanted` (replacing an entry with that key), written whole or not at all. A file that
    cannot be written costs the next start a calibration, not this one its start: a warning, no error."""
    entries = [entry for entry in _entries(path) if entry.get("key") != wanted]
    measured = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    entries = [*entries, {"key": wanted, "measured": measured, "costs": costs.to_dict()}][-KEPT:]
    target = Path(path).expanduser()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=target.parent, prefix=f".{target.name}.", delete=False) as out:
            json.dump({"format": FORMAT, "entries": entries}, out, indent=1)
        os.replace(out.name, target)
    except OSError as exc:
        log.warning("calibration: could not store the costs in %s (%s); the next start calibrates again", path, exc)
        return
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


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return ""
