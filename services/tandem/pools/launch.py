"""Starting one pool worker in two halves: asking Ray for it (at once, under the pool manager's lock) and waiting until
it has loaded its model (minutes, outside the lock, on a thread of its own).

Why two halves: a worker Ray cannot place (the cluster has no room and no autoscaler adds any) would otherwise hold
the manager's lock for as long as it waits, so that every later scale, the one that would correct the count, waited
behind it. A worker that is asked for but not yet answering is *starting*: it is not offered to gateways, a scale
down stops it first, and `progress` says whether Ray has placed it yet (`pending`) or it is loading (`loading`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.pools.manager import PoolSpec
    from tandem.workers.tp_replica import TensorParallelReplica
    from tandem.workers.worker_base import WorkerConfig


@dataclass(slots=True)
class Launched:
    """A worker asked of Ray: `handle` is what gateways call (a tensor-parallel replica's rank 0)."""

    role: str
    name: str
    handle: object
    group: TensorParallelReplica | None = None  # a tensor-parallel replica's ranks and placement group

    @property
    def actors(self) -> list:
        return self.group.ranks if self.group is not None else [self.handle]


def launch(spec: PoolSpec, draft: WorkerConfig | None, role: str, index: int) -> Launched:
    """Ask Ray for worker `{role}-{index}` of the pool and return without waiting for it."""
    from tandem.workers.draft_pool import start_draft_workers
    from tandem.workers.target_pool import start_target_replicas
    from tandem.workers.tp_replica import start_tp_replica

    options, name = spec.options, f"{role}-{index}"
    naming = {"first": index, "detached_prefix": spec.actor_prefix, "wait": False}
    if role == "target" and options.tensor_parallel > 1:
        group = start_tp_replica(spec.target, options.tensor_parallel, name=name,
                                 gpus_per_rank=options.target_gpus_per_rank, cpus_per_rank=options.cpus_per_worker,
                                 resources=options.target_resources, detached_prefix=spec.actor_prefix, wait=False)
        return Launched(role, name, group.ranks[0], group)
    if role == "target":
        [handle] = start_target_replicas(spec.target, 1, num_gpus=options.target_gpus_per_rank,
                                         num_cpus=options.cpus_per_worker, resources=options.target_resources,
                                         **naming)
    else:
        [handle] = start_draft_workers(draft, 1, num_gpus=options.draft_gpus, num_cpus=options.cpus_per_worker,
                                       resources=options.draft_resources, **naming)
    return Launched(role, name, handle)


def find_launched(spec: PoolSpec, roles: tuple[str, ...]) -> list[Launched]:
    """The pool's workers as Ray holds them, found by their names (a restarted manager's), in name order."""
    import ray

    from tandem.pools.names import NAMESPACE

    prefix, tp, found = spec.actor_prefix, spec.options.tensor_parallel, []
    for actor in ray.util.list_named_actors(all_namespaces=True):
        name = actor["name"]
        role, _, index = name[len(prefix):].rpartition("-")  # a tensor-parallel rank's "-rank1" is no index
        if actor["namespace"] == NAMESPACE and name.startswith(prefix) and role in roles and index.isdigit():
            found.append((role, int(index), name))
    launched = []
    for role, index, name in sorted(found):
        worker, group = f"{role}-{index}", None
        if role == "target" and tp > 1:
            from tandem.workers.tp_replica import find_tp_replica  # the model stack: only where a replica has ranks

            group = find_tp_replica(prefix, worker, tp)
        launched.append(Launched(role, worker, ray.get_actor(name, namespace=NAMESPACE), group))
    return launched


def await_started(launched: Launched) -> None:
    """Block until the worker has loaded its model; raises as `worker_base.get_started` does (a tandem error for a
    model that failed its checks). The caller stops a worker whose start failed."""
    from tandem.workers.tp_replica import finish_tp_replica
    from tandem.workers.worker_base import get_started

    if launched.group is not None:
        finish_tp_replica(launched.group)
    else:
        get_started([launched.handle.info.remote()], launched.role)


def placement(spec: PoolSpec, launched: Launched) -> dict:
    """A starting worker's state: `loading` once Ray has placed every actor of it, else `pending` with what one
    worker asks for and what the cluster has free."""
    import ray

    from tandem.pools.health import actor_placed

    if all(actor_placed(actor) for actor in launched.actors):  # a tensor-parallel rank waits for its group's room
        return {"state": "loading"}
    free = {key: value for key, value in ray.available_resources().items()
            if not key.startswith(("node:", "bundle_group_"))}  # the per-node and per-bundle markers are no room
    return {"state": "pending", "asks": demand(spec, launched.role), "available": free}


def demand(spec: PoolSpec, role: str) -> dict[str, float]:
    """The Ray resources one worker of `role` asks for (a tensor-parallel replica: every rank's together)."""
    options = spec.options
    if role == "target":
        ranks, extra = options.tensor_parallel, options.target_resources or {}
        asked = {"CPU": options.cpus_per_worker * ranks, "GPU": options.target_gpus_per_rank * ranks}
    else:
        ranks, extra = 1, options.draft_resources or {}
        asked = {"CPU": options.cpus_per_worker, "GPU": options.draft_gpus}
    asked |= {key: value * ranks for key, value in extra.items()}
    return {key: value for key, value in asked.items() if value}
