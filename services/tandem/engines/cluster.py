"""Backends over Ray pools: a draft-worker pool and tensor-parallel target replicas, started for this server.

The server process holds only the tokenizer and the engine's bookkeeping; models live in Ray actors. Workers are
reached through Ray actor calls rather than a second gRPC contract: Ray already places them (GPU requests,
placement groups), restarts them, and serialises the small messages a round needs (token ids, the truncated draft
distribution), so one more RPC layer would add a hop and nothing else.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor

from tandem.core.config import EngineConfig
from tandem.core.detok import decoder
from tandem.core.model_options import compiles, draft_vocab_limit
from tandem.engines.backend import Backend, engine_lanes
from tandem.engines.options import Arm, ClusterOptions
from tandem.workers.draft_pool import RayDrafter, start_draft_workers
from tandem.workers.target_pool import RayVerifier, start_target_replicas, target_tokenizer
from tandem.workers.tp_replica import start_tp_replica
from tandem.workers.worker_base import WorkerConfig

log = logging.getLogger(__name__)
_own_ray = False  # start_ray started a local Ray in this process (rather than joining one)

def start_ray(options: ClusterOptions) -> None:
    """Join RAY_ADDRESS (or options.ray_address), else start a local Ray on loopback sized for our actors, with
    token authentication on (tandem.ray_auth) and no dashboard."""
    import ray

    from tandem import ray_auth

    if ray.is_initialized():
        return
    address = options.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray_auth.join_cluster(address, options.ray_token_file)
        return
    ray_auth.configure_local_cluster(options.ray_token_file)
    cpus = max(os.cpu_count() or 1, int(options.actors * options.cpus_per_worker) + 1)
    # No dashboard (its job API runs code for anyone who reaches it); were it ever turned on, loopback only.
    # address="local": without it ray.init joins a cluster `ray start` left on this machine (and refuses num_cpus).
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, dashboard_host="127.0.0.1",
             _node_ip_address="127.0.0.1",
             runtime_env=ray_auth.RUNTIME_ENV, log_to_driver=False, configure_logging=False)
    global _own_ray
    _own_ray = True


def joined_ray(options: ClusterOptions) -> bool:
    """Whether the workers run on a Ray this process did not start on its own host: an address given, or one already
    initialised by someone else (a test's, an embedding program's). `tandem serve` starts its local Ray before
    building (start_ray), so an initialised Ray alone does not say it was joined."""
    import ray

    return bool(options.ray_address or os.environ.get("RAY_ADDRESS")) or (ray.is_initialized() and not _own_ray)

def worker_threads(options: ClusterOptions, joined: bool) -> tuple[int | None, int | None]:
    """Torch threads of each draft worker and each target rank: --threads; else, on a Ray this server starts on its
    own host, all of the host's cores (a tensor-parallel replica's ranks, which run at once, split them); else
    (`joined`: a cluster) None: Ray sets an actor's OpenMP threads to the CPUs it reserves, one. On one host draft
    and target forwards mostly take turns, so each may use every core: with one thread each, `tandem serve` with the
    real pair on CPU-B decoded 1.43-1.58x slower and started 1.41x slower (docs/performance.md)."""
    if options.threads is not None or joined:
        return options.threads, options.threads
    cores = len(os.sched_getaffinity(0))
    return cores, max(1, cores // options.tensor_parallel)


def build_cluster_backends(target: str, arms: tuple[Arm, ...], options: ClusterOptions,
                           lanes: int = 1) -> dict[str, Backend]:
    """Pull the models once here, start Ray and the workers, and return one backend per arm over one shared target
    pool; arms with the same draft model share its draft pool. With tensor-parallel replicas each arm gets replicas
    of its own: a failed replica is rebuilt by the one pool client that holds it."""
    from tandem.models.loader import resolve, vocab_size

    draft_threads, target_threads = worker_threads(options, joined_ray(options))
    drafting = {arm.name for arm in arms if arm.draft and arm.config.spec.speculating and options.draft_workers > 0}
    # Pulls a registry model once, before several workers would race for it; each worker verifies what it loads.
    target_vocab = vocab_size(target)
    first_arms: dict[str, Arm] = {}  # draft model -> the first arm drafting with it: its config makes the workers
    for arm in arms:
        if arm.name in drafting and arm.draft not in first_arms:
            resolve(arm.draft, verify=False)  # likewise
            first_arms[arm.draft] = arm
    start_ray(options)
    # Every pool starts at once (loads, compiles): a draft's vocabulary cap, the target's, came from its config.
    with ThreadPoolExecutor(thread_name_prefix="tandem-start") as starting:
        targets = [starting.submit(_start_target_pool, target, options, target_threads)
                   for _ in (arms if options.tensor_parallel > 1 else arms[:1])]
        drafts = {draft: starting.submit(_start_draft_pool, draft, arm.config, options, target_vocab, draft_threads)
                  for draft, arm in first_arms.items()}
    target_pools = [future.result() for future in targets]
    draft_pools = {draft: future.result() for draft, future in drafts.items()}
    tokenizer, eos = target_tokenizer(target_pools[0], "this server's target pool")
    backends = {}
    for n, arm in enumerate(arms):
        replicas = target_pools[n if options.tensor_parallel > 1 else 0]
        workers = draft_pools[arm.draft] if arm.name in drafting else []

        def sides(lane: int, replicas: list = replicas, workers: list = workers,
                  name: str = arm.name) -> tuple[RayVerifier, RayDrafter | None]:
            # To the workers, each lane and each arm is a gateway of its own (its own sequence-id prefix).
            prefix = f"{name}/{lane}/" if name or lanes > 1 else ""
            drafter = RayDrafter(workers, timeout_s=options.draft_timeout_s, prefix=prefix) if workers else None
            return RayVerifier(replicas, prefix=prefix), drafter

        engines = engine_lanes(sides, lanes, arm.config, eos, decoder(tokenizer))
        draft_name = arm.draft if arm.config.spec.speculating else ""
        backends[arm.name] = Backend(engines[0], tokenizer, target, draft_name, lanes=tuple(engines[1:]))
        log.info("%sready: %d draft worker(s), %d target replica(s) x TP %d, %d lane(s)",
                 f"arm {arm.name}: " if arm.name else "cluster ", len(workers), len(replicas),
                 options.tensor_parallel, lanes)
    return backends

def _start_target_pool(target: str, options: ClusterOptions, threads: int | None) -> list:
    config = WorkerConfig(model=target, **_worker_common(options, draft=False, threads=threads))
    if options.tensor_parallel > 1:
        return [start_tp_replica(config, options.tensor_parallel, name=f"target-{i}",
                                 gpus_per_rank=options.target_gpus_per_rank, cpus_per_rank=options.cpus_per_worker,
                                 resources=options.target_resources)
                for i in range(options.target_replicas)]
    return start_target_replicas(config, options.target_replicas, num_gpus=options.target_gpus_per_rank,
                                 num_cpus=options.cpus_per_worker, resources=options.target_resources)

def _start_draft_pool(draft: str, config: EngineConfig, options: ClusterOptions, vocab: int,
                      threads: int | None) -> list:
    spec = config.spec
    worker = WorkerConfig(model=draft, top_m=spec.draft_top_m, confidence=spec.stop_confidence,
                          draft_vocab=draft_vocab_limit(spec.draft_vocab, vocab),
                          quantization=options.draft_quantization,
                          **_worker_common(options, draft=True, threads=threads))
    return start_draft_workers(worker, options.draft_workers, num_gpus=options.draft_gpus,
                               num_cpus=options.cpus_per_worker, resources=options.draft_resources)

def _worker_common(options: ClusterOptions, draft: bool, threads: int | None) -> dict:
    return {"device": options.device, "dtype": options.dtype, "threads": threads, "eager": options.eager,
            "compile": compiles(options.compile, draft), "kv_tokens": options.kv_tokens,
            "retain_tokens": options.retain_tokens, "prefix_cache": options.prefix_cache}
