"""Engines over models loaded in this process: the engine itself, and the backends `tandem serve --in-process`
builds (the target loaded once, each distinct draft model once, one engine per arm)."""

from __future__ import annotations

import os

from tandem.core.config import EngineConfig
from tandem.core.costs import CostModel
from tandem.core.detok import decoder
from tandem.core.engine import SpeculativeEngine
from tandem.core.format_masks import FormatMasks
from tandem.core.local import LocalDrafter, LocalVerifier
from tandem.core.model_options import DEFAULT_RETAIN_TOKENS, compiles, draft_vocab_limit
from tandem.core.runner import ModelRunner
from tandem.engines.backend import Backend
from tandem.engines.options import Arm, LocalOptions
from tandem.errors import InvalidArgument
from tandem.models.loader import eos_token_ids, runner_mode


def build_engine(target, draft=None, config: EngineConfig | None = None, kv_tokens: int = 0,
                 costs: CostModel | None = None, retain_tokens: int = DEFAULT_RETAIN_TOKENS,
                 prefix_cache: bool = True) -> SpeculativeEngine:
    """target and draft are LoadedModel-like objects with .model and .tokenizer; draft None means plain decoding.
    `kv_tokens`: each model's KV token budget (0: a share of the memory free when its runner starts). `costs`: a cost
    model to start from (shared with other engines, or fixed), else a fresh one that calibration fills.
    `retain_tokens`: how many tokens of finished sequences' caches each runner keeps for a session's next turn or a
    prefix shared with later requests. `prefix_cache`: new requests start from a copy of a cached prefix of their
    prompt (core.runner)."""
    config = config or EngineConfig()
    pad = target.tokenizer.pad_token_id or 0
    eos = eos_token_ids(target.model, target.tokenizer)
    verifier = LocalVerifier(ModelRunner(target.model, pad_token_id=pad, kv_tokens=kv_tokens,
                                         retain_tokens=retain_tokens, prefix_cache=prefix_cache,
                                         **runner_mode(target)),
                             FormatMasks(target.tokenizer, eos))
    drafter = None
    if draft is not None and config.spec.speculating:
        runner = ModelRunner(draft.model, pad_token_id=pad,
                             vocab_limit=draft_vocab_limit(config.spec.draft_vocab, verifier.vocab_size),
                             kv_tokens=kv_tokens, retain_tokens=retain_tokens, prefix_cache=prefix_cache,
                             **runner_mode(draft))
        drafter = LocalDrafter(runner, top_m=config.spec.draft_top_m, confidence=config.spec.stop_confidence,
                               formats=FormatMasks(target.tokenizer, eos))
    for compiling in (verifier.runner, drafter and drafter.runner):
        if compiling is not None:
            compiling.warm_up()  # compiles at start, not in the first requests (a GPU's default)
    return SpeculativeEngine(verifier, drafter, config, eos, decoder(target.tokenizer), costs=costs)


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidArgument("chat: this model's tokenizer has no chat template; drop --chat")
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(prompt)


def build_local_backends(target: str, arms: tuple[Arm, ...], options: LocalOptions) -> dict[str, Backend]:
    """{arm: Backend} over models loaded here: the target once, each distinct draft once (checked to share the
    target's tokenizer), one engine per arm."""
    from tandem.models.loader import check_compatible, load_models

    device, dtype = _setup_torch(options)
    names = list(dict.fromkeys(arm.draft for arm in arms if arm.config.spec.speculating and arm.draft))
    draft_options = {"quantization": options.draft_quantization, "compile": compiles(options.compile, draft=True)}
    target_model, *loaded = load_models([(target, {"compile": compiles(options.compile, draft=False)}),
                                         *((name, draft_options) for name in names)],
                                        device=device, dtype=dtype, eager=options.eager)
    drafts: dict[str, object] = dict(zip(names, loaded, strict=True))
    for draft_model in loaded:
        check_compatible(draft_model, target_model)
    backends = {}
    for arm in arms:
        draft = arm.draft if arm.config.spec.speculating else ""
        engine = build_engine(target_model, drafts[draft] if draft else None, arm.config, kv_tokens=options.kv_tokens,
                              retain_tokens=options.retain_tokens, prefix_cache=options.prefix_cache)
        backends[arm.name] = Backend(engine, target_model.tokenizer, target, draft,
                                     fills_cpus=_fills_cpus(device))
    return backends


def _fills_cpus(device) -> bool:
    """Whether forwards on `device` run on as many threads as this process may use CPUs (on a CPU, by default)."""
    import torch

    return device.type == "cpu" and torch.get_num_threads() >= len(os.sched_getaffinity(0))


def _setup_torch(options: LocalOptions):
    """(device, dtype) for the models, with torch's thread count set when options ask."""
    import torch

    from tandem.core.device import select_device, select_dtype

    if options.threads is not None:
        torch.set_num_threads(options.threads)
    device = select_device(options.device)
    return device, select_dtype(options.dtype, device)
