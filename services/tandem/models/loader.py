"""Turn a model spec (registry name, HF directory, .gguf file or hub id) into a ready model and tokenizer.

Two supply-chain checks happen here, before a model is loaded: a pulled model's directory must still match the
per-file sha256 of its manifest (models.verify), and a hub id must name a commit (models.hub) unless the caller
allows an unpinned one, which is then resolved to its current commit once so that model and tokenizer agree.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tandem.core import cpu_runtime
from tandem.core.fused_linear import stack_on_gpu
from tandem.core.gc_pause import collector_paused
from tandem.core.int8_linear import quantize_int8
from tandem.core.model_options import (
    DEFAULT_DRAFT_QUANTIZATION,
    check_model_mode,
    compiles,
    resolve_quantization,
)
from tandem.core.packed_linear import prepack
from tandem.core.w4_linear import quantize_w4
from tandem.core.w8a8_linear import quantize_w8a8
from tandem.errors import IncompatibleModels, InvalidArgument
from tandem.models.file_views import copy_file_views
from tandem.models.hub import hub_local_only, hub_not_found, hub_ref, pin, require_pinned
from tandem.models.registry import REGISTRY
from tandem.models.source import Source, local_source, not_found
from tandem.models.store import use_compile_cache
from tandem.models.verify import verify_model_dir

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadedModel:
    spec: str
    path: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    eager: bool = False  # loaded without the device's fast path; runners then skip CUDA graphs too
    compile: bool = False  # runners compile their decode forwards (torch.compile) on a CPU too, not only on a GPU
    quantization: str = "none"  # "int8", "w8a8" or "w4": quantized linear weights (drafts only, core.model_options)

    @property
    def weights(self) -> str:
        """How the linear weights are held, as workers and `tandem pools status` report it: the quantization, else
        the dtype ("bfloat16")."""
        return self.quantization if self.quantization != "none" else str(self.model.dtype).removeprefix("torch.")


def runner_mode(loaded) -> dict:
    """The ModelRunner arguments a loaded model (or a LoadedModel-like object) asks for: no CUDA graphs when eager;
    compiled forwards on a CPU too when it was loaded with `compile` (None leaves the choice to the device: compiled
    where CUDA graphs run)."""
    return {"cuda_graphs": not getattr(loaded, "eager", False),
            "compile": True if getattr(loaded, "compile", False) else None}


def eos_token_ids(model, tokenizer) -> frozenset[int]:
    """The ids a model's output ends at: its generation config's and its tokenizer's end-of-sequence tokens."""
    ids: set[int] = set()
    generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (generation_eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return frozenset(ids)


def resolve(spec: str, *, progress: bool = True, pip_args: list[str] | None = None,
            allow_unpinned: bool = False, verify: bool = True) -> Source:
    """Where `spec`'s model is, pulling a registry model first. `verify`: re-hash a pulled directory against its
    manifest (every load does); a process that only pulls or reads the config for workers that load may skip it."""
    if spec in REGISTRY:
        from tandem.models.pull import pull

        source = Source(str(pull(spec, progress=progress, pip_args=pip_args)))
        return verify_source(source, spec, progress) if verify else source
    local = local_source(spec)
    if local is not None:
        return verify_source(local, spec, progress) if verify else local
    ref = hub_ref(spec)
    require_pinned(spec, ref, allow_unpinned)  # before any network access

    from transformers import AutoConfig

    local_only = hub_local_only()
    try:
        ref = pin(spec, ref, local_files_only=local_only)  # with allow_unpinned: this load's one commit
        AutoConfig.from_pretrained(ref.repo_id, revision=ref.revision, local_files_only=local_only)
    except Exception as exc:  # hub errors come as OSError, ValueError, HTTP errors and more
        raise not_found(spec, hub_not_found(local_only)) from exc
    return Source(ref.repo_id, local_files_only=local_only, revision=ref.revision)


def verify_source(source: Source, spec: str, progress: bool = False) -> Source:
    """`source` (a registry model's or a local directory's, as resolve found it), once its files match its manifest
    where it has one (models.verify; IntegrityError where they do not). `spec` names a registry model."""
    if source.gguf_file is None:  # only a pulled model's directory has one
        verify_model_dir(Path(source.path), name=spec if spec in REGISTRY else None, progress=progress)
    return source


def vocab_size(spec: str) -> int:
    """The output vocabulary of the model `spec` names, from its config alone (no weights loaded): what a runner of
    it reports as `vocab_size`. Pulls a registry model first; checking its files is left to whatever loads it."""
    from transformers import AutoConfig

    source = resolve(spec, verify=False)
    return int(AutoConfig.from_pretrained(source.path, **source.hub_kwargs()).vocab_size)


@collector_paused()
def load_model(
    spec: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    progress: bool = True,
    pip_args: list[str] | None = None,
    extra: dict[str, Any] | None = None,
    eager: bool = False,
    allow_unpinned: bool = False,
    quantization: str = "none",
    compile: bool = False,
    source: Source | None = None,
) -> LoadedModel:
    """Resolve spec (pulling a registry model on first use) and load it for inference on device in dtype; `source`:
    where resolve found it, its files already checked (load_models).

    `extra` goes to from_pretrained as is (for example tp_plan="auto" inside a torch.distributed group). Unless
    `eager`, the model is prepared for this device's fast path (core.packed_linear: oneDNN prepacked linears for bf16
    on CPU; on a GPU sibling projections stacked into one product, core.fused_linear, and the runner replays CUDA
    graphs, core.cuda_graphs); `eager` leaves it as from_pretrained built it and says so to the runners. An unpinned
    hub id is refused unless `allow_unpinned` (see resolve and pin_spec).
    `quantization` "int8" holds the linear weights as int8 (core.int8_linear), "w8a8" as int8 for oneDNN's int8 GEMM
    (core.w8a8_linear), "w4" as those with an int4 copy for one-row steps (core.w4_linear), "auto" as
    core.model_options.resolve_quantization picks for this device and dtype: for draft models only, since the
    target's logits are the distribution the engine reproduces. The LoadedModel records what was picked.
    `compile` tells the runners to compile their decode forwards on a CPU as well (a GPU's default): forwards run
    5-13% faster after minutes of compiling at start. No cyclic garbage collection runs meanwhile (core.gc_pause).
    """
    check_model_mode(eager, compile)
    asked, quantization = quantization, resolve_quantization(quantization, device, dtype, eager)
    if asked == "auto":  # say what auto picked: on a worker, the logs are the only place that shows it
        log.info("%s: weights held as %s (quantization auto, on %s in %s)", spec, quantization, device.type,
                 str(dtype).removeprefix("torch."))
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    if source is None:
        source = resolve(spec, progress=progress, pip_args=pip_args, allow_unpinned=allow_unpinned)
    use_compile_cache()  # before the runners compile anything
    common = source.hub_kwargs()
    model_kwargs: dict[str, Any] = dict(extra or {})
    if source.gguf_file is not None:
        model_kwargs["quantization_config"] = GgufConfig(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(
        source.path, dtype=dtype, attn_implementation="sdpa", **common, **model_kwargs
    )
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    model.to(device)
    model.eval()
    if quantization != "none":
        try:
            {"int8": quantize_int8, "w8a8": quantize_w8a8, "w4": quantize_w4}[quantization](model)
        except ValueError as exc:
            raise InvalidArgument(f"model {spec!r}: {exc}") from exc
    if not eager:
        prepack(model)  # the linears left as nn.Linear, if any (CPU)
        stack_on_gpu(model)
        # Or the mapped checkpoint file stays in memory whole for a few views. An eager model's weights are the views.
        copy_file_views(model)
    # Parameters keep requires_grad as from_pretrained leaves them (inference runs under inference_mode or no_grad, so
    # no graph is built). Turning it off changes torch's CPU matmul for a strided [1, n, H] input (a slice of hidden
    # states, as generate's logits_to_keep feeds the LM head): it no longer folds into one mm but runs a bf16 bmm
    # that copies the whole transposed head weight, 1.3-2.7 s against 25-40 ms for the real pair's heads.
    tokenizer = AutoTokenizer.from_pretrained(source.path, **common)
    path = str(Path(source.path) / source.gguf_file) if source.gguf_file else source.path
    if device.type == "cpu":
        cpu_runtime.advise()  # once per process, after a model loaded: what to preload for a faster torch on a CPU
    return LoadedModel(spec=spec, path=path, model=model, tokenizer=tokenizer, eager=eager, compile=compile,
                       quantization=quantization)


def _config_vocab_size(loaded: LoadedModel) -> int:
    return int(loaded.model.config.get_text_config().vocab_size)


def check_compatible(draft: LoadedModel, target: LoadedModel) -> None:
    """Raise IncompatibleModels unless the draft's token ids mean the same as the target's."""
    draft_vocab = draft.tokenizer.get_vocab()
    target_vocab = target.tokenizer.get_vocab()
    special = ("eos_token_id", "bos_token_id")
    same_special = all(getattr(draft.tokenizer, a) == getattr(target.tokenizer, a) for a in special)
    if draft_vocab != target_vocab or not same_special:
        raise IncompatibleModels(
            f"draft {draft.spec!r} (vocab {len(draft_vocab)}) and target {target.spec!r} "
            f"(vocab {len(target_vocab)}) use different tokenizers; "
            f"pick a draft that shares the target's tokenizer"
        )
    draft_size, target_size = _config_vocab_size(draft), _config_vocab_size(target)
    if draft_size > target_size:
        raise IncompatibleModels(
            f"draft {draft.spec!r} has a larger output vocabulary ({draft_size}) than target "
            f"{target.spec!r} ({target_size}); pick a draft that shares the target's tokenizer"
        )


def load_pair(
    draft_spec: str,
    target_spec: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    progress: bool = True,
    pip_args: list[str] | None = None,
    eager: bool = False,
    draft_quantization: str = DEFAULT_DRAFT_QUANTIZATION,
    compile: bool | str = False,
) -> tuple[LoadedModel, LoadedModel]:
    """Load a draft and a target and check that they can be paired; returns (draft, target). `compile`: a
    core.model_options.COMPILE_SCOPES scope ("draft": the draft's runners alone compile), or a bool for both or
    neither."""
    draft, target = load_models([(draft_spec, {"quantization": draft_quantization,
                                                "compile": compiles(compile, draft=True)}),
                                 (target_spec, {"compile": compiles(compile, draft=False)})],
                                device=device, dtype=dtype, progress=progress, pip_args=pip_args, eager=eager)
    check_compatible(draft, target)
    return draft, target


@collector_paused()
def load_models(loads: list[tuple[str, dict[str, Any]]], *, progress: bool = True,
                pip_args: list[str] | None = None, **common: Any) -> list[LoadedModel]:
    """load_model of each (spec, its own arguments) in turn, with `common` arguments for all. Every model is pulled
    first where it is not yet (one after the other), then their files are hashed (models.verify: sha256 runs at about
    1.4 GB/s on a core) on a thread of their own: the first model's while this thread imports transformers' modeling
    code, each later one's while the ones before it load."""
    def checkable(spec: str) -> bool:  # a hub id has no manifest: load_model resolves it itself
        return spec in REGISTRY or local_source(spec) is not None

    pulled = {spec: resolve(spec, progress=progress, pip_args=pip_args, verify=False)
              for spec, _ in loads if checkable(spec)}
    with ThreadPoolExecutor(1, thread_name_prefix="verify") as checks:
        checked = [checks.submit(verify_source, pulled[spec], spec) if spec in pulled else None for spec, _ in loads]
        import transformers.modeling_utils  # noqa: F401  # what a load imports first (3.6 s cold), while they hash
        return [load_model(spec, source=None if check is None else check.result(), progress=progress,
                           pip_args=pip_args, **common, **own)
                for (spec, own), check in zip(loads, checked, strict=True)]
