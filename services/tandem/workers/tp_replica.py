"""A tensor-parallel target replica: N Ray actors in one placement group, one torch.distributed rank each.

Every rank holds a shard of the target (transformers' tp_plan="auto": column/row-parallel linears, gloo on CPU,
NCCL on GPU) and its shard of each sequence's KV cache. The replica sends each call to all ranks in the same order;
the ranks run identical verification logic with random numbers keyed by the request's seed (the engine picks one
for unseeded requests) and token position, so they sample alike, and rank 0's reply is the answer.
A rank that dies takes the group with it (its peers would wait in collectives): `rebuild` replaces every rank and
the placement group, and the engine resends the sessions' histories.

A shared pool's replica (tandem.pools) serves many gateways, whose calls could reach the ranks in different orders
and deadlock their collectives. There rank 0 leads: gateways call it alone, its batcher merges their calls into one
forward, and before each forward (or release) it broadcasts the call to the other ranks over a gloo group of its own
(vLLM's driver worker does alike), so every rank runs the same calls in one order.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from datetime import timedelta

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tandem.pools.names import NAMESPACE
from tandem.workers.target_worker import TargetWorker
from tandem.workers.worker_base import (
    MAX_CONCURRENT_CALLS,
    WorkerBase,
    WorkerConfig,
    WorkerReply,
    get_started,
    load_runner,
)

log = logging.getLogger(__name__)
CONTROL_TIMEOUT = timedelta(days=365)  # followers wait on the control group between calls, however long traffic pauses


class TensorParallelRank(TargetWorker):
    """A target worker whose model is loaded only once its process group is up (in `setup`)."""

    def __init__(self, config: WorkerConfig, rank: int, world: int, name: str = "target", lead: bool = False) -> None:
        self.config, self.rank, self.world = config, rank, world
        WorkerBase.__init__(self, name if lead else f"{name}-rank{rank}", config.batch_window_s, config.metrics_port)
        self.lead = lead  # shared pools: rank 0 takes every call and broadcasts it to the others
        self.control = None  # the gloo group rank 0 broadcasts calls over (a shared replica of 2+ ranks)

    def owns_sequences(self) -> bool:
        return self.rank == 0  # rank 0's releases reach the others (broadcast in a shared pool, by the replica else)

    def rendezvous_address(self) -> tuple[str, int]:
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, address: str, port: int, timeout_s: float = 120.0) -> None:
        import torch
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR=address, MASTER_PORT=str(port), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world), LOCAL_RANK="0")
        backend = "nccl" if self.config.device.startswith("cuda") and torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, rank=self.rank, world_size=self.world, timeout=timedelta(seconds=timeout_s))
        # A shared replica's rank 0 decides for every rank (it broadcasts each forward, reruns included).
        self._take(self.batcher.on_model_thread(load_runner, self.config, 0,
                                                {"tp_plan": "auto"} if self.world > 1 else None),
                   timed_formats=self.lead or self.world == 1)
        if self.lead and self.world > 1:
            self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
            if self.rank:
                threading.Thread(target=self._follow, name="tandem-tp-follow", daemon=True).start()

    def _broadcast(self, call: tuple) -> tuple:
        import torch.distributed as dist

        box = [call]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    # Rank 0 broadcasts on its model thread (the batcher runs forwards and releases alike there, one at a time), so
    # the other ranks receive forwards and releases in the order rank 0 runs them.
    def _run(self, requests: list) -> WorkerReply:
        if self.control is not None and self.rank == 0:
            self._broadcast(("verify", requests))
        return super()._run(requests)

    def _release(self, seq_ids: list[str], retain: bool) -> None:
        if self.control is not None and self.rank == 0:
            self._broadcast(("release", seq_ids, retain))
        super()._release(seq_ids, retain)

    def _follow(self) -> None:
        """Ranks other than 0 of a shared replica: run rank 0's calls in its order, for as long as the group lives."""
        while True:
            call = self._broadcast(None)
            try:
                if call[0] == "verify":
                    super()._run(call[1])
                else:
                    super()._release(call[1], call[2])
            except Exception:  # rank 0 hit the same error in the same call and answers for the replica
                log.exception("rank %d: %s failed", self.rank, call[0])


class _AllRanks:
    def __init__(self, ranks: list, method: str) -> None:
        self.ranks, self.method = ranks, method

    def remote(self, *args):
        refs = [getattr(rank, self.method).remote(*args) for rank in self.ranks]
        return refs[0]


class TensorParallelReplica:
    """Looks like one target worker to the pool: `replica.verify.remote(...)` runs on every rank."""

    def __init__(self, ranks: list, group, start: dict) -> None:
        self.ranks, self.group, self.start = ranks, group, start

    def __getattr__(self, method: str) -> _AllRanks:
        return _AllRanks(self.ranks, method)

    def call(self, method: str, *args) -> list:
        """Every rank's reference for one call (rank 0's first), so a caller can notice a dead rank at once."""
        return [getattr(rank, method).remote(*args) for rank in self.ranks]

    def rebuild(self) -> None:
        """Replace every rank (a fresh process group and placement group); blocks while the model loads."""
        stop_tp_replica(self)
        fresh = start_tp_replica(**self.start)
        self.ranks, self.group = fresh.ranks, fresh.group


def start_tp_replica(config: WorkerConfig, size: int, name: str = "target", gpus_per_rank: float = 0.0,
                     cpus_per_rank: float = 1.0, resources: dict[str, float] | None = None,
                     detached_prefix: str | None = None, wait: bool = True) -> TensorParallelReplica:
    """`resources`: custom Ray resources each rank needs (e.g. {"target_pool": 1} to land on that worker group).
    With `detached_prefix` (shared pools) the ranks and the placement group outlive their starter: rank 0 is named
    `{prefix}{name}` and leads (gateways call it alone), the others `{prefix}{name}-rank{i}`. Without `wait` the
    replica is returned once its placement group and ranks are asked for: `finish_tp_replica` waits for them."""
    bundle = {"CPU": cpus_per_rank} | ({"GPU": gpus_per_rank} if gpus_per_rank else {}) | (resources or {})
    shared = detached_prefix is not None
    group = placement_group([bundle] * size, strategy="STRICT_PACK",
                            **({"name": f"{detached_prefix}{name}", "lifetime": "detached"} if shared else {}))
    actor = ray.remote(TensorParallelRank)
    options = {"num_cpus": cpus_per_rank, "num_gpus": gpus_per_rank, "resources": resources or {}}
    if shared:
        options |= {"lifetime": "detached", "namespace": NAMESPACE, "max_concurrency": MAX_CONCURRENT_CALLS}
    # Ranks asked for before their group is placed wait for it; Ray places none of them until it is.
    ranks = [actor.options(**options, **_rank_name(detached_prefix, name, i),
                           scheduling_strategy=
                           PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=i))
             .remote(config, rank=i, world=size, name=name, lead=shared) for i in range(size)]
    start = {"config": config, "size": size, "name": name, "gpus_per_rank": gpus_per_rank,
             "cpus_per_rank": cpus_per_rank, "resources": resources, "detached_prefix": detached_prefix}
    replica = TensorParallelReplica(ranks, group, start)
    if wait:
        finish_tp_replica(replica)
    return replica


def finish_tp_replica(replica: TensorParallelReplica) -> None:
    """Wait until the replica's ranks are placed, joined in one process group and loaded; a failure stops them all,
    so that no rank or reserved bundle outlives a start that failed."""
    try:
        address, port = ray.get(replica.ranks[0].rendezvous_address.remote())
        get_started([rank.setup.remote(address, port) for rank in replica.ranks], "tensor-parallel target")
    except BaseException:
        stop_tp_replica(replica)
        raise


def _rank_name(prefix: str | None, name: str, rank: int) -> dict:
    if prefix is None:
        return {}
    return {"name": f"{prefix}{name}" if rank == 0 else f"{prefix}{name}-rank{rank}"}


def find_tp_replica(prefix: str, name: str, size: int) -> TensorParallelReplica:
    """A shared replica's ranks and placement group, found by name (a restarted pool manager adopting them)."""
    ranks = [ray.get_actor(_rank_name(prefix, name, i)["name"], namespace=NAMESPACE) for i in range(size)]
    return TensorParallelReplica(ranks, ray.util.get_placement_group(f"{prefix}{name}"), {})


def stop_tp_replica(replica: TensorParallelReplica) -> None:
    for rank in replica.ranks:
        ray.kill(rank, no_restart=True)
    remove_placement_group(replica.group)
