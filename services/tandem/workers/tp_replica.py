"""A tensor-parallel target replica: N Ray actors in one placement group, one torch.distributed rank each.

Every rank holds a shard of the target (transformers' tp_plan="auto": column/row-parallel linears, gloo on CPU,
NCCL on GPU) and its shard of each sequence's KV cache. The replica sends each call to all ranks in the same order;
the ranks run identical verification logic with random numbers keyed by the request's seed (the engine picks one
for unseeded requests) and token position, so they sample alike, and rank 0's reply is the answer.
A rank that dies takes the group with it (its peers would wait in collectives): `rebuild` replaces every rank and
the placement group, and the engine resends the sessions' histories.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tandem.core.local import LocalVerifier
from tandem.workers.target_worker import TargetWorker
from tandem.workers.worker_base import WorkerBase, WorkerConfig, load_runner


class TensorParallelRank(TargetWorker):
    """A target worker whose model is loaded only once its process group is up (in `setup`)."""

    def __init__(self, config: WorkerConfig, rank: int, world: int, name: str = "target") -> None:
        WorkerBase.__init__(self, f"{name}-rank{rank}")
        self.config, self.rank, self.world = config, rank, world

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
        self.runner = load_runner(self.config, extra={"tp_plan": "auto"} if self.world > 1 else None)
        self.verifier = LocalVerifier(self.runner)


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
        for rank in self.ranks:
            ray.kill(rank, no_restart=True)
        remove_placement_group(self.group)
        fresh = start_tp_replica(**self.start)
        self.ranks, self.group = fresh.ranks, fresh.group


def start_tp_replica(config: WorkerConfig, size: int, name: str = "target", gpus_per_rank: float = 0.0,
                     cpus_per_rank: float = 1.0, resources: dict[str, float] | None = None) -> TensorParallelReplica:
    """`resources`: custom Ray resources each rank needs (e.g. {"target_pool": 1} to land on that worker group)."""
    bundle = {"CPU": cpus_per_rank} | ({"GPU": gpus_per_rank} if gpus_per_rank else {}) | (resources or {})
    group = placement_group([bundle] * size, strategy="STRICT_PACK")
    ray.get(group.ready())
    actor = ray.remote(TensorParallelRank)
    ranks = [actor.options(num_cpus=cpus_per_rank, num_gpus=gpus_per_rank, resources=resources or {},
                           scheduling_strategy=
                           PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=i))
             .remote(config, rank=i, world=size, name=name) for i in range(size)]
    address, port = ray.get(ranks[0].rendezvous_address.remote())
    ray.get([rank.setup.remote(address, port) for rank in ranks])
    start = {"config": config, "size": size, "name": name, "gpus_per_rank": gpus_per_rank,
             "cpus_per_rank": cpus_per_rank, "resources": resources}
    return TensorParallelReplica(ranks, group, start)
