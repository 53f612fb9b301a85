"""What draft and target workers share: loading a model into a runner, and telling lost sequences apart.

Ray imports a worker's module wherever a handle to the worker is made (it loads the actor's class by reference to
learn its methods), and every gateway over shared pools makes handles. So this module and the workers' own import
torch and the model stack only where a worker loads its model (`load_runner`): a gateway imports none of it.
"""

from __future__ import annotations

import gc
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tandem.core.gc_pause import freeze_loaded_heap
from tandem.core.model_options import DEFAULT_RETAIN_TOKENS
from tandem.core.protocol import KVCacheFull, KVUsage, StateLost, WorkerLoad
from tandem.errors import RequestRefused, TandemError, WorkerStartFailed
from tandem.hostinfo import host_facts
from tandem.pools.names import NAMESPACE
from tandem.telemetry.worker import WorkerTelemetry
from tandem.workers.batcher import CallBatcher
from tandem.workers.kv_order import HeldOrder
from tandem.workers.orphans import release_orphans_forever

if TYPE_CHECKING:
    from tandem.core.runner import ModelRunner


def ray_failures() -> tuple[type[BaseException], ...]:
    """Exceptions that mean a worker died, is restarting, or raised: its calls' results are lost."""
    import ray

    return (ray.exceptions.RayActorError, ray.exceptions.RayTaskError, ray.exceptions.ActorUnavailableError)


# The exception line that ends a remote traceback, where the exception is one of tandem's own user-facing errors.
_TANDEM_ERROR_LINE = re.compile(r"^tandem\.errors\.\w+: ", re.MULTILINE)
_HOST = re.compile(r"\bip=([^,)\s]+)")


def user_error(exc: BaseException) -> TandemError | None:
    """The tandem error (meant for users) a remote call raised, if that is what `exc` carries."""
    import ray

    if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(exc.cause, TandemError):
        return exc.cause
    return None


def in_ray_actor() -> bool:
    """Whether this code runs in a Ray actor's process (a worker tested in-process runs in the test's)."""
    import ray

    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def get_started(refs, role: str):
    """`ray.get` over calls that say `role` workers have started. A worker whose start raised a tandem error (its
    model failed its checks, a bad argument) stops the start with that message and the worker's host, not Ray's
    remote traceback; any other failure propagates as Ray raised it, traceback and all (that is what finds a bug).
    A constructor's error reaches here only as the text of Ray's ActorDiedError, which keeps no exception object."""
    import ray

    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as exc:  # raised in a method (a tensor-parallel rank loads in `setup`)
        if (cause := user_error(exc)) is None:
            raise
        failed = WorkerStartFailed(f"a {role} worker on {worker_host(str(exc))} could not start: {cause}")
    except ray.exceptions.RayActorError as exc:  # raised in the constructor
        text = str(exc)
        if not exc.actor_init_failed or not (lines := list(_TANDEM_ERROR_LINE.finditer(text))):
            raise
        message = text[lines[-1].end():].strip()  # the last exception raised, to the end of its message
        failed = WorkerStartFailed(f"a {role} worker on {worker_host(text)} could not start: {message}")
    raise failed


def worker_host(remote_error: str) -> str:
    """The worker's address as Ray's text of a remote error gives it: `(pid=..., ip=...)`."""
    return found.group(1) if (found := _HOST.search(remote_error)) else "an unknown host"


@dataclass(slots=True, frozen=True)
class WorkerConfig:
    model: str
    device: str = "auto"
    dtype: str = "auto"
    threads: int | None = None
    top_m: int = 64
    confidence: float = 0.0
    draft_vocab: int = 0  # ids the drafter scores (0: all); the backend caps it at the target's vocabulary
    kv_tokens: int = 0  # the runner's KV token budget (0: a share of the memory free at start)
    eager: bool = False  # the model as Hugging Face builds it (no prepacked linears)
    compile: bool = False  # decode forwards compiled by torch.compile on a CPU too (a GPU's default)
    quantization: str = "none"  # "int8", "w8a8" or "w4": quantized weights (draft workers only, core.model_options)
    batch_window_s: float = 0.0  # how long a call waits for other gateways' calls to join its forward (shared pools)
    retain_tokens: int = DEFAULT_RETAIN_TOKENS  # finished sequences' cache tokens the runner keeps (core.slots)
    prefix_cache: bool = True  # new sequences start from a copy of a cached prefix of their prompt (core.slots)
    # The first port of the workers' /metrics (-1: none; None: $TANDEM_WORKER_METRICS_PORT where the worker runs).
    metrics_port: int | None = None


@dataclass(slots=True)
class WorkerReply:
    """Either results, or the ids this worker no longer holds (it restarted, or never saw them), or that its KV
    cache is full (KVCacheFull's fields: needed and capacity tokens, others' sequences ahead), or that one row's own
    request cannot go on (RequestRefused's sequence id and message: the caller fails that request and sends the
    others again)."""

    results: list | None = None
    lost: list[str] | None = None
    full: tuple[int, int, bool] | None = None
    refused: tuple[str, str] | None = None
    spans: list[dict] | None = None  # finished spans of traced rows, for the gateway to export (telemetry.worker)
    load: WorkerLoad | None = None  # what the worker holds after the call, for every caller (routing.observe)


@dataclass(slots=True, frozen=True)
class LoadedRunner:
    """A worker's model in its runner, with the model's tokenizer and end-of-sequence ids: a target worker hands
    those to the gateways (`TargetWorker.tokenizer`), which then need no model files of their own."""

    runner: ModelRunner
    tokenizer: Any  # transformers' PreTrainedTokenizerBase
    eos_token_ids: frozenset[int]
    threads: int  # torch's CPU threads on the model thread, where the worker's forwards run
    weights: str  # how the model's weights are held: its quantization ("w4": what "auto" picked) or its dtype


def load_runner(config: WorkerConfig, vocab_limit: int = 0, extra: dict | None = None) -> LoadedRunner:
    import torch

    from tandem.core.device import select_device, select_dtype
    from tandem.core.runner import ModelRunner
    from tandem.models.loader import eos_token_ids, load_model, runner_mode

    if config.threads:
        torch.set_num_threads(config.threads)
    device = select_device(config.device)
    loaded = load_model(config.model, device=device, dtype=select_dtype(config.dtype, device), progress=False,
                        extra=extra, eager=config.eager, compile=config.compile, quantization=config.quantization)
    runner = ModelRunner(loaded.model, pad_token_id=loaded.tokenizer.pad_token_id or 0, vocab_limit=vocab_limit,
                         kv_tokens=config.kv_tokens, retain_tokens=config.retain_tokens,
                         prefix_cache=config.prefix_cache, **runner_mode(loaded))
    runner.warm_up()  # compiles at start, not in the first requests (a GPU's default)
    return LoadedRunner(runner, loaded.tokenizer, eos_token_ids(loaded.model, loaded.tokenizer),
                        torch.get_num_threads(), loaded.weights)


class WorkerBase:
    role = "worker"

    def __init__(self, name: str, batch_window_s: float = 0.0, metrics_port: int | None = None) -> None:
        self.name = name
        self.runner: ModelRunner
        self.threads = 0  # torch's threads for the forwards, once the model is loaded (LoadedRunner.threads)
        self.weights = ""  # how its model's weights are held, once loaded (LoadedRunner.weights)
        self.order = HeldOrder()  # which held sequences a call that does not fit may free (workers.kv_order)
        self.evicted = 0  # sequences freed for calls that came before them
        self.batcher = CallBatcher(self._run, batch_window_s)
        self.telemetry = WorkerTelemetry(name, self.role, kv_usage=self.kv_usage)
        self.telemetry.serve_metrics_from_env(metrics_port)
        threading.Thread(target=release_orphans_forever, args=(self,), name="tandem-orphans", daemon=True).start()

    def _hold(self, loaded: LoadedRunner) -> None:
        self.runner, self.threads, self.weights = loaded.runner, loaded.threads, loaded.weights
        if in_ray_actor():  # a process of its own, loaded for good: its model and tokenizer out of every collection
            freeze_loaded_heap()

    def serve_metrics(self, port: int = 0, host: str | None = None) -> str:
        """Serve this worker's Prometheus /metrics (also started at construction by TANDEM_WORKER_METRICS_PORT)."""
        return self.telemetry.serve_metrics(port, host)

    def _run(self, requests: list) -> WorkerReply:
        """One forward over `requests` (the calls the batcher merged)."""
        raise NotImplementedError

    def _serve(self, requests: list, run: Callable[[list], list], free: Callable[[str], None]) -> WorkerReply:
        """`run(requests)` as a reply; while the cache cannot hold the call, `free` the held sequences of other calls
        that come after every row of it, the last first (workers.kv_order)."""
        self.order.note(requests, self.runner.states)
        reply = self._fit(requests, run, free)
        reply.load = self.load()
        return reply

    def _fit(self, requests: list, run: Callable[[list], list], free: Callable[[str], None]) -> WorkerReply:
        while True:
            try:
                return WorkerReply(results=run(requests))
            except StateLost as lost:
                return WorkerReply(lost=lost.seq_ids)
            except KVCacheFull as full:
                held = list(self.runner.states)
                if (victim := self.order.victim(requests, held)) is None:
                    return WorkerReply(full=(full.needed, full.capacity, self.order.others_held(requests, held)))
                free(victim)
                self.order.forget(victim)
                self.evicted += 1
                self.telemetry.evicted()
            except RequestRefused as refused:
                return WorkerReply(refused=(refused.request_id, str(refused)))

    def release(self, seq_ids: list[str], retain: bool = False) -> None:
        self.batcher.on_model_thread(self._release, seq_ids, retain)

    def _release(self, seq_ids: list[str], retain: bool) -> None:
        """Drop these sequences' caches (on the model thread, where `_run` runs too)."""
        for seq_id in seq_ids:
            self.runner.release(seq_id, retain)

    def sequence_ids(self) -> list[str]:
        if getattr(self, "runner", None) is None:  # a tensor-parallel rank before `setup`
            return []
        return self.batcher.on_model_thread(lambda: list(self.runner.states))

    def owns_sequences(self) -> bool:
        """Whether this worker decides when its sequences are released (not a follower rank of a shared replica)."""
        return True

    def cached_sequences(self) -> int:
        """Sequences this worker holds for every caller (0 while a tensor-parallel rank waits for `setup`)."""
        runner = getattr(self, "runner", None)
        return len(runner.states) if runner is not None else 0

    def load(self) -> WorkerLoad | None:
        """What this worker holds for every caller, as gateways place new sequences by it (routing.observe); None
        while a tensor-parallel rank waits for `setup`. Answered on the actor's call threads, even mid-forward."""
        runner = getattr(self, "runner", None)
        if runner is None:
            return None
        sequences, longest = runner.running_load()
        return WorkerLoad(sequences, longest, runner.kv_tokens_capacity)

    def kv_usage(self) -> KVUsage | None:
        """This worker's KV tokens; None while its model is loading (a tensor-parallel rank before `setup`)."""
        runner = getattr(self, "runner", None)
        return KVUsage.of(runner) if runner is not None else None

    def info(self) -> dict:
        return {"name": self.name, "pid": os.getpid(), "host": host_facts(), "threads": self.threads,
                "weights": self.weights,
                "sequences": self.cached_sequences(),
                "vocab_size": self.runner.vocab_size,
                "context_window": self.runner.context_window, "retained_sessions": self.runner.retained_sessions,
                "retained_prefixes": self.runner.retained_prefixes, "shared_tokens": self.runner.shared_tokens,
                **self.runner.layout.to_info(),
                "reused_tokens": self.runner.reused_tokens, "metrics": self.telemetry.metrics_url,
                "kv_tokens_used": self.runner.kv_tokens_used, "kv_tokens_reserved": self.runner.kv_tokens_reserved,
                "kv_tokens_capacity": self.runner.kv_tokens_capacity, "forwards": self.batcher.stats.forwards,
                "rows": self.batcher.stats.rows, "merged_forwards": self.batcher.stats.merged,
                "busy_s": round(self.batcher.stats.busy_s, 3),
                "rows_per_forward": self.batcher.stats.rows_per_forward(),
                "calls_per_forward": self.batcher.stats.calls_per_forward(), "evicted": self.evicted,
                "gc_frozen_objects": gc.get_freeze_count()}


MAX_CONCURRENT_CALLS = 64  # calls a worker holds at once (from every gateway and lane); they merge into forwards


def start_workers(worker_class: type, config: WorkerConfig, count: int, name: str, num_gpus: float = 0.0,
                  num_cpus: float = 1.0, resources: dict[str, float] | None = None, first: int = 0,
                  detached_prefix: str | None = None, wait: bool = True) -> list:
    """Start `count` actors of `worker_class` named `{name}-{first}`...; Ray restarts any that die (their sessions
    are rebuilt from history). With `detached_prefix` they are detached actors named `{prefix}{name}-{i}` in the
    tandem namespace: they outlive the process that started them (shared pools, tandem.pools). Without `wait` the
    actors are returned as soon as Ray has them to place: the caller waits for their start (`get_started` over
    `info`), as the pool manager does outside its lock."""
    import ray

    options = {"num_gpus": num_gpus, "num_cpus": num_cpus, "resources": resources or {}, "max_restarts": -1,
               "max_task_retries": 0, "max_concurrency": MAX_CONCURRENT_CALLS}
    actor = ray.remote(worker_class)
    workers = []
    for i in range(first, first + count):
        extra = ({"name": f"{detached_prefix}{name}-{i}", "lifetime": "detached", "namespace": NAMESPACE}
                 if detached_prefix else {})
        workers.append(actor.options(**options, **extra).remote(config, name=f"{name}-{i}"))
    if not wait:
        return workers
    try:
        get_started([w.info.remote() for w in workers], name)
    except BaseException:
        for worker in workers:  # those that did start would otherwise hold their CPUs (or, detached, outlive us)
            ray.kill(worker, no_restart=True)
        raise
    return workers
