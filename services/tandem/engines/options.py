"""What to build: the models, one engine configuration per arm, and where the models run (here, or Ray pools)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.core.config import EngineConfig
from tandem.core.model_options import (
    DEFAULT_DRAFT_QUANTIZATION,
    DEFAULT_RETAIN_TOKENS,
    QUANTIZATIONS,
    check_device_and_dtype,
    check_model_mode,
    check_retain_tokens,
    compile_scope,
)
from tandem.errors import InvalidArgument


def _check_models(options: LocalOptions | ClusterOptions) -> None:
    """What both placements check of how their models are loaded and run."""
    if options.draft_quantization not in QUANTIZATIONS:
        raise InvalidArgument(f"draft_quantization: one of {', '.join(QUANTIZATIONS)}, "
                              f"got {options.draft_quantization!r}")
    check_device_and_dtype(options.device, options.dtype)
    check_model_mode(options.eager, options.compile)
    check_retain_tokens(options.retain_tokens)
    object.__setattr__(options, "compile", compile_scope(options.compile))  # True/False given: "all"/"none"


@dataclass(slots=True, frozen=True)
class LocalOptions:
    """Models loaded in this process."""

    device: str = "auto"
    dtype: str = "auto"
    threads: int | None = None  # torch's CPU threads (None: all cores)
    eager: bool = False  # models as Hugging Face builds them (no prepacked linears, no CUDA graphs)
    compile: str = "none"  # whose decode forwards compile on a CPU too (core.model_options.COMPILE_SCOPES)
    kv_tokens: int = 0  # each model's KV token budget (0: a share of the memory free when its runner starts)
    draft_quantization: str = DEFAULT_DRAFT_QUANTIZATION  # the draft's weights (core.model_options; output unchanged)
    retain_tokens: int = DEFAULT_RETAIN_TOKENS  # finished requests' cache tokens each model keeps (core.slots)
    prefix_cache: bool = True  # new requests start from a copy of a cached prefix of their prompt (core.slots)

    def __post_init__(self) -> None:
        _check_models(self)
        if self.threads is not None and self.threads < 1:
            raise InvalidArgument(f"threads: must be at least 1, got {self.threads}")
        if self.kv_tokens < 0:
            raise InvalidArgument(f"kv_tokens: must be non-negative (0: a share of free memory), got {self.kv_tokens}")


@dataclass(slots=True, frozen=True)
class ClusterOptions:
    """Models in Ray actors: a draft-worker pool and target replicas (each of `tensor_parallel` ranks)."""

    draft_workers: int = 1
    target_replicas: int = 1
    tensor_parallel: int = 1
    draft_gpus: float = 0.0
    target_gpus_per_rank: float = 0.0
    draft_resources: dict[str, float] | None = None  # custom Ray resources per draft worker (a worker group's)
    target_resources: dict[str, float] | None = None  # ... and per target rank
    cpus_per_worker: float = 1.0
    ray_address: str | None = None
    ray_token_file: str | None = None  # Ray token auth (tandem.ray_auth); else $RAY_AUTH_TOKEN(_PATH) or a fresh one
    draft_timeout_s: float = 5.0
    threads: int | None = None
    device: str = "auto"
    dtype: str = "auto"
    eager: bool = False  # models as Hugging Face builds them (no prepacked linears)
    compile: str = "none"  # whose decode forwards compile on a CPU too (core.model_options.COMPILE_SCOPES)
    kv_tokens: int = 0  # every worker's KV token budget (0: a share of the memory free when it starts)
    draft_quantization: str = DEFAULT_DRAFT_QUANTIZATION  # draft workers' weights, per device (core.model_options)
    retain_tokens: int = DEFAULT_RETAIN_TOKENS  # finished requests' cache tokens each model keeps (core.slots)
    prefix_cache: bool = True  # new requests start from a copy of a cached prefix of their prompt (core.slots)

    def __post_init__(self) -> None:
        _check_models(self)
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


@dataclass(slots=True, frozen=True)
class Arm:
    """One backend to build. `name` keys it in what engines.build returns (a canary arm's name, or "" for a server's
    only backend); `draft` is its draft model ("" decodes plainly, as does a config that does not speculate)."""

    name: str = ""
    draft: str = ""
    config: EngineConfig = field(default_factory=EngineConfig)


@dataclass(slots=True, frozen=True)
class BuildOptions:
    """Backends over one target model: one per arm (in order, the first the baseline), the models in this process or
    in Ray pools; `lanes`: engines per backend over the same workers (engines.lanes); `calibration_file`: where
    measured costs are kept across restarts ("" for none; engines.calibration_file)."""

    target: str
    arms: tuple[Arm, ...] = (Arm(),)
    placement: LocalOptions | ClusterOptions = field(default_factory=LocalOptions)
    lanes: int = 1
    calibration_file: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "arms", tuple(self.arms))
        names = [arm.name for arm in self.arms]
        if not names:
            raise InvalidArgument("arms: build at least one backend")
        if len(set(names)) != len(names):
            raise InvalidArgument(f"arms: names must be unique, got {names}")
        if self.lanes < 1:
            raise InvalidArgument(f"lanes: must be at least 1, got {self.lanes}")
        if self.lanes > 1 and isinstance(self.placement, LocalOptions):
            raise InvalidArgument("lanes: --in-process runs one engine over its models (lanes need Ray workers)")
        if self.lanes > 1 and isinstance(self.placement, ClusterOptions) and self.placement.tensor_parallel > 1:
            raise InvalidArgument("lanes: engine lanes over tensor-parallel replicas are not supported (each lane "
                                  "would rebuild a failed replica on its own); use --lanes 1 with --tp")
