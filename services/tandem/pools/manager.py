"""The pool manager: one named detached actor per pool that starts, scales, describes and stops its workers.

Why named detached actors and not Ray Serve deployments: a speculative round is two short calls (draft, verify) per
step, and a gateway must reach the exact replica that holds a session's KV cache. Actor calls go straight to the
worker; a Serve handle adds its router and a proxy hop per call and routes by its own policy (custom routers can pin
sessions, but every call still passes the router). The per-call overhead of both, measured here:
tandem.bench.pool_overhead (docs/bench/pool-overhead-v1.json: 1.19 ms median per actor call, 4.08 ms through
Serve). Scaling, health and restarts are the manager's and Ray's (max_restarts) job; the Ray autoscaler grows nodes
from the workers' resource requests.

The model stack (the workers' modules, torch) is imported inside the methods that start and stop workers: a process
that only asks a manager (`tandem pools status`) gets its handle, and Ray loads an actor's class by reference to make
one, so this module must import in a fraction of a second.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray

from tandem.core.config import EngineConfig
from tandem.core.costs import CostModel
from tandem.core.model_options import draft_vocab_limit
from tandem.errors import InvalidArgument
from tandem.pools.health import actor_state, succeeded, worker_health
from tandem.pools.launch import Launched, find_launched, placement
from tandem.pools.names import check_pool_name, manager_name
from tandem.pools.starting import WorkerStarts

if TYPE_CHECKING:
    from tandem.engines.options import ClusterOptions
    from tandem.workers.tp_replica import TensorParallelReplica
    from tandem.workers.worker_base import WorkerConfig

log = logging.getLogger(__name__)

ROLES = ("draft", "target")
IMAGE_ENV = "TANDEM_IMAGE"  # the image a process runs (the Helm chart sets it): pools and gateways must agree
PRUNE_EVERY_S = 2.0  # how often the manager looks for workers that died for good
ADOPT_WAIT_S = 2.0  # a restarted manager's wait for its workers' answers: one that does not answer is starting


@dataclass(slots=True, frozen=True)
class PoolSpec:
    name: str
    target: WorkerConfig
    draft: WorkerConfig | None  # None: the pool decodes plainly
    options: ClusterOptions
    engine: EngineConfig  # what gateways attached to this pool run (they may change batching only)
    image: str = ""  # $TANDEM_IMAGE of whoever started the pools: gateways of another image refuse to attach
    # The target's output vocabulary (models.loader.vocab_size): draft workers never score ids beyond it. Known
    # before any worker starts, so draft and target workers start (load, compile) at once.
    target_vocab: int = 0

    def __post_init__(self) -> None:
        check_pool_name(self.name)
        if self.draft is not None and self.target_vocab < 1:
            raise InvalidArgument(f"target_vocab: the target's vocabulary size, needed with a draft, got "
                                  f"{self.target_vocab}")

    @property
    def actor_prefix(self) -> str:
        return f"{manager_name(self.name)}-"


class PoolManager(WorkerStarts):
    def __init__(self, spec: PoolSpec) -> None:
        self.spec = spec
        self.workers: dict[str, dict[str, object]] = {role: {} for role in ROLES}  # role -> {name: handle}
        # Workers asked of Ray and not yet loaded (pools.launch): not offered to gateways; a scale down stops them
        # first. A start that failed leaves its role, message and time in `failures`.
        self.starting: dict[str, Launched] = {}
        self.failures: OrderedDict[str, dict] = OrderedDict()
        self.next_index = dict.fromkeys(ROLES, 0)
        # Tensor-parallel target replicas by name: gateways call rank 0 (in `workers`), which leads the others. One
        # dead rank breaks its group, so the manager replaces the whole group.
        self.groups: dict[str, TensorParallelReplica] = {}
        # The first gateway's measured costs, by its --max-batch; a restarted manager has them back from the gateways
        # attached to it (engines.shared_pools), which follow its incarnation.
        self.calibrations: dict[int, CostModel] = {}
        self.generation = 0
        # Draft workers never score ids the target lacks: their vocabulary is cut to the target's.
        self.draft_config = spec.draft and dataclasses.replace(
            spec.draft, draft_vocab=draft_vocab_limit(spec.draft.draft_vocab, spec.target_vocab))
        self._lock = threading.Lock()  # the manager serves several calls at once (status, scale, the pruner)
        self._stopped = threading.Event()
        # Gateways compare (incarnation, generation): a restarted manager, or pools stopped and started anew, is a
        # new incarnation whose generation count starts again.
        self.incarnation = uuid.uuid4().hex
        if ray.get_runtime_context().was_current_actor_reconstructed:
            self._adopt_workers()
            threading.Thread(target=self._prune_dead, name="tandem-pools-prune", daemon=True).start()

    def _adopt_workers(self) -> None:
        """A restarted manager (its node or the Ray head restarted; the detached workers lived on) finds its workers
        again by their names. Those that answer serve on; one that does not was still starting (not placed, or
        loading) and is waited for again; a tensor-parallel replica that does not was being set up by the manager
        that died, which alone could finish it, so a fresh one replaces it."""
        adopted = find_launched(self.spec, ROLES)
        for launched in adopted:
            role, index = launched.name.rsplit("-", 1)
            self.next_index[role] = max(self.next_index[role], int(index) + 1)
            if launched.group is not None:
                self.groups[launched.name] = launched.group
        answers = [launched.handle.info.remote() for launched in adopted]
        answered, _ = ray.wait(answers, num_returns=len(answers), timeout=ADOPT_WAIT_S) if answers else ([], [])
        for launched, answer in zip(adopted, answers, strict=True):
            if answer in answered and succeeded(answer):
                self.workers[launched.role][launched.name] = launched.handle
            elif launched.group is not None:
                self._remove(launched.role, launched.name, launched.handle)
                self._begin(launched.role, 1)
            else:
                self._wait_for(launched)
        log.warning("pools %s: manager restarted, adopted %s, starting %s", self.spec.name,
                    {role: list(workers) for role, workers in self.workers.items()}, list(self.starting))

    def start(self) -> dict:
        """Ask for every worker, draft and target at once, and return the pools' description at once: the starter
        follows their loading with `progress` (pools.waiting) and stops the pools if any fails."""
        options = self.spec.options
        roles = [("target", options.target_replicas)] + ([("draft", options.draft_workers)] if self.spec.draft else [])
        with self._lock:
            for role, count in roles:
                self._begin(role, count)
        threading.Thread(target=self._prune_dead, name="tandem-pools-prune", daemon=True).start()
        return self.describe()

    def calibration(self, max_batch: int) -> CostModel | None:
        """Costs a gateway measured on these pools with batches up to `max_batch` (None: none yet)."""
        return self.calibrations.get(max_batch)

    def record_calibration(self, max_batch: int, costs: CostModel) -> None:
        with self._lock:
            self.calibrations.setdefault(max_batch, costs)

    def _prune_dead(self) -> None:
        """Drop workers that died for good (killed without restart, their node gone for good): gateways follow the
        membership and stop routing to them. A worker that crashed is restarted by Ray (max_restarts) and stays. A
        tensor-parallel replica with a dead rank is replaced by a fresh group under a new name (its sessions move,
        their histories resent)."""
        while not self._stopped.wait(PRUNE_EVERY_S):
            with self._lock:
                if self._drop_dead():
                    self.generation += 1

    def _drop_dead(self) -> bool:
        """Drop (or replace, for a tensor-parallel group) the workers that died for good; True when there were any.
        Under the lock."""
        dead = [(role, name) for role in ROLES for name, handle in self.workers[role].items()
                if any(actor_state(actor) == "DEAD" for actor in self._actors(name, handle))]
        for role, name in dead:
            log.warning("pools %s: %s worker %s died; removed from the pool", self.spec.name, role, name)
            handle = self.workers[role].pop(name)
            if name in self.groups:
                self._replace_group(role, name, handle)
        return bool(dead)

    def _replace_group(self, role: str, name: str, handle) -> None:
        try:
            self._remove(role, name, handle)
            self._begin(role, 1)
        except Exception:  # no room for a new group now: the pool runs on with one replica fewer
            log.exception("pools %s: could not replace tensor-parallel replica %s", self.spec.name, name)

    def _actors(self, name: str, handle) -> list:
        group = self.groups.get(name)
        return group.ranks if group is not None else [handle]

    def describe(self) -> dict:
        """What a gateway needs to attach: models, engine config, and the workers' actor names in order."""
        return {"name": self.spec.name, "target": self.spec.target.model,
                "draft": self.spec.draft.model if self.spec.draft else "", "engine": self.spec.engine,
                "generation": self.generation, "incarnation": self.incarnation,
                "actor_prefix": self.spec.actor_prefix, "image": self.spec.image,
                "tensor_parallel": self.spec.options.tensor_parallel,
                "workers": {role: list(self.workers[role].copy()) for role in ROLES},
                "starting": {role: [n for n, w in self.starting.copy().items() if w.role == role] for role in ROLES}}

    def scale(self, role: str, count: int) -> dict:
        if self._stopped.is_set():  # workers started now would outlive the manager, owned by no pool
            raise InvalidArgument(f"pools: {self.spec.name!r} are stopping")
        if role not in ROLES:
            raise InvalidArgument(f"role: draft or target, got {role!r}")
        if count < 1:
            raise InvalidArgument(f"count: a pool keeps at least one {role} worker, got {count}")
        if role == "draft" and self.spec.draft is None:
            raise InvalidArgument("draft: this pool has no draft model")
        with self._lock:
            # A worker that died since the last prune does not count: scaling to 1 right after the last one died
            # must start one, not find the dead one still listed.
            if self._drop_dead():
                self.generation += 1
            current, starting = self.workers[role], [n for n, w in self.starting.items() if w.role == role]
            if count > len(current) + len(starting):
                self._begin(role, count - len(current) - len(starting))
            while starting and len(current) + len(starting) > count:  # those not serving yet go first, newest first
                launched = self.starting.pop(starting.pop())
                self._remove(role, launched.name, launched.handle)
            if len(current) > count:
                while len(current) > count:  # the newest go first: the oldest hold the longest-lived sessions
                    self._remove(role, *current.popitem())
                self.generation += 1
        return self.describe()

    def progress(self, names: list[str]) -> dict[str, dict]:
        """Where each named worker's start stands: ready, pending (Ray has not placed it: no node has room for what
        it asks), loading, failed (with the error), or stopped (a later scale or `stop` ended it, or it died)."""
        out: dict[str, dict] = {}
        for name in names:
            role = name.rpartition("-")[0]
            if role in ROLES and name in self.workers[role]:
                out[name] = {"state": "ready"}
            elif (launched := self.starting.get(name)) is not None:
                out[name] = placement(self.spec, launched)
            elif name in self.failures:
                out[name] = {"state": "failed", "error": self.failures[name]["error"]}
            else:
                out[name] = {"state": "stopped"}
        return out

    def status(self) -> dict:
        workers = worker_health({role: self.workers[role].copy() for role in ROLES})
        starting = [{"role": w.role, "name": name, "healthy": False, "state": placement(self.spec, w)["state"]}
                    for name, w in self.starting.copy().items()]  # pending (no room yet) or loading
        targets = [w for w in workers if w["role"] == "target" and w["healthy"] and w["forwards"]]
        rows = sum(w["rows_per_forward"] for w in targets) / len(targets) if targets else 0.0
        return {"name": self.spec.name, "target": self.spec.target.model,
                "draft": self.spec.draft.model if self.spec.draft else "", "generation": self.generation,
                "image": self.spec.image, "manager_pid": os.getpid(),
                "tensor_parallel": self.spec.options.tensor_parallel, "calibrated_batches": sorted(self.calibrations),
                "workers": workers + starting,
                "failed_starts": [{"name": name} | failed for name, failed in self.failures.copy().items()],
                "rows_per_verify_call": round(rows, 3)}

    def stop(self) -> None:
        with self._lock:  # a scale (or a replacement) under way finishes first; later ones find the pools stopping
            self._stopped.set()
            for launched in self.starting.values():
                self._remove(launched.role, launched.name, launched.handle)
            self.starting.clear()
            for role in ROLES:
                for name, handle in self.workers[role].items():
                    self._remove(role, name, handle)
                self.workers[role].clear()

    def _remove(self, role: str, name: str, handle) -> None:
        if name in self.groups:
            from tandem.workers.tp_replica import stop_tp_replica

            stop_tp_replica(self.groups.pop(name))
        else:
            ray.kill(handle, no_restart=True)
