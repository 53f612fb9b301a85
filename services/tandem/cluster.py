"""The distributed backend behind `tandem serve`: Ray, the draft-worker pool and tensor-parallel target replicas.

The gateway process holds only the tokenizer and the engine's bookkeeping; models live in Ray actors. Workers are
reached through Ray actor calls rather than a second gRPC contract: Ray already places them (GPU requests,
placement groups), restarts them, and serialises the small messages a round needs (token ids, the truncated draft
distribution), so one more RPC layer would add a hop and nothing else.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from tandem.core.config import EngineConfig
from tandem.core.engine import SpeculativeEngine
from tandem.errors import InvalidArgument
from tandem.gateway.servicer import Backend
from tandem.local_engine import decoder, draft_vocab_limit
from tandem.workers.draft_pool import RayDrafter, start_draft_workers
from tandem.workers.target_pool import RayVerifier, start_target_replicas
from tandem.workers.tp_replica import start_tp_replica
from tandem.workers.worker_base import WorkerConfig

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class ClusterOptions:
    draft_workers: int = 1
    target_replicas: int = 1
    tensor_parallel: int = 1
    draft_gpus: float = 0.0
    target_gpus_per_rank: float = 0.0
    draft_resources: dict[str, float] | None = None  # custom Ray resources per draft worker (a worker group's)
    target_resources: dict[str, float] | None = None  # ... and per target rank
    cpus_per_worker: float = 1.0
    ray_address: str | None = None
    draft_timeout_s: float = 5.0
    threads: int | None = None
    device: str = "auto"
    dtype: str = "auto"
    eager: bool = False  # models as Hugging Face builds them (no prepacked linears)
    kv_tokens: int = 0  # every worker's KV token budget (0: a share of the memory free when it starts)

    def __post_init__(self) -> None:
        if self.draft_workers < 0:
            raise InvalidArgument(f"draft_workers: must be non-negative, got {self.draft_workers}")
        if self.target_replicas < 1:
            raise InvalidArgument(f"target_replicas: must be at least 1, got {self.target_replicas}")
        if self.tensor_parallel < 1:
            raise InvalidArgument(f"tp: must be at least 1, got {self.tensor_parallel}")
        if self.kv_tokens < 0:
            raise InvalidArgument(f"kv_tokens: must be non-negative (0: a share of free memory), got {self.kv_tokens}")
        for name in ("draft_resources", "target_resources"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, dict) and all(
                    isinstance(k, str) and isinstance(v, int | float) and v > 0 for k, v in value.items())):
                raise InvalidArgument(f"{name}: must map resource names to positive amounts, got {value!r}")

    @property
    def actors(self) -> int:
        return self.draft_workers + self.target_replicas * self.tensor_parallel


def start_ray(options: ClusterOptions) -> None:
    """Join RAY_ADDRESS (or options.ray_address), else start a local Ray on loopback sized for our actors."""
    import ray

    if ray.is_initialized():
        return
    address = options.ray_address or os.environ.get("RAY_ADDRESS")
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}
    if address:
        ray.init(address=address, runtime_env=env, log_to_driver=False)
        return
    cpus = max(os.cpu_count() or 1, int(options.actors * options.cpus_per_worker) + 1)
    ray.init(num_cpus=cpus, include_dashboard=False, _node_ip_address="127.0.0.1", runtime_env=env,
             log_to_driver=False, configure_logging=False)


def load_tokenizer(spec: str):
    from transformers import AutoTokenizer, GenerationConfig

    from tandem.models.loader import resolve

    source = resolve(spec)
    kwargs = {"local_files_only": source.local_files_only}
    if source.gguf_file:
        kwargs["gguf_file"] = source.gguf_file
    tokenizer = AutoTokenizer.from_pretrained(source.path, **kwargs)
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    try:
        generation_eos = GenerationConfig.from_pretrained(source.path, **kwargs).eos_token_id
    except OSError:
        generation_eos = None
    eos |= set(generation_eos if isinstance(generation_eos, list) else [generation_eos] if generation_eos else [])
    return tokenizer, frozenset(eos)


def start_backend(target: str, draft: str | None, config: EngineConfig, options: ClusterOptions) -> Backend:
    """Pull models once here, start Ray and the workers, and return an engine driving them."""
    tokenizer, eos = load_tokenizer(target)
    if draft:
        load_tokenizer(draft)  # pulls a registry draft once, before several workers would race for it
    start_ray(options)
    spec = config.spec
    common = {"device": options.device, "dtype": options.dtype, "threads": options.threads, "eager": options.eager,
              "kv_tokens": options.kv_tokens}
    target_config = WorkerConfig(model=target, **common)
    if options.tensor_parallel > 1:
        replicas = [start_tp_replica(target_config, options.tensor_parallel, name=f"target-{i}",
                                     gpus_per_rank=options.target_gpus_per_rank,
                                     cpus_per_rank=options.cpus_per_worker, resources=options.target_resources)
                    for i in range(options.target_replicas)]
    else:
        replicas = start_target_replicas(target_config, options.target_replicas,
                                         num_gpus=options.target_gpus_per_rank, num_cpus=options.cpus_per_worker,
                                         resources=options.target_resources)
    verifier = RayVerifier(replicas)
    drafter = None
    if draft and spec.speculating and options.draft_workers:
        draft_config = WorkerConfig(model=draft, top_m=spec.draft_top_m, confidence=spec.stop_confidence,
                                    draft_vocab=draft_vocab_limit(spec.draft_vocab, verifier.vocab_size), **common)
        workers = start_draft_workers(draft_config, options.draft_workers, num_gpus=options.draft_gpus,
                                      num_cpus=options.cpus_per_worker, resources=options.draft_resources)
        drafter = RayDrafter(workers, timeout_s=options.draft_timeout_s)
    engine = SpeculativeEngine(verifier, drafter, config, eos, decoder(tokenizer))
    log.info("cluster ready: %d draft worker(s), %d target replica(s) x TP %d", options.draft_workers,
             options.target_replicas, options.tensor_parallel)
    return Backend(engine, tokenizer, target, draft or "")
