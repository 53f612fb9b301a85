"""Tiny, deterministic Qwen2-architecture models for tests and benchmarks.

make_tiny writes a target, a draft built to agree with the target's greedy choice most of the time,
and an unrelated random draft, all sharing one tokenizer (models.tiny_tokenizer).
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import GenerationConfig, Qwen2Config

from tandem.models.tiny_tokenizer import TOKENIZER_FILES, TokenizerInfo, copy_source_tokenizer, write_byte_tokenizer


@dataclass(slots=True, frozen=True)
class TinyPair:
    target: Path
    draft: Path
    draft_random: Path


@dataclass(slots=True, frozen=True)
class TinyShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int


TARGET_SHAPE = TinyShape(hidden=64, layers=6, heads=4, kv_heads=2, intermediate=128)
DRAFT_SHAPE = TinyShape(hidden=64, layers=1, heads=4, kv_heads=2, intermediate=128)

# Gains relative to 1/sqrt(fan_in). Large gains keep the first layer's attention context-dependent, so
# greedy continuations do not collapse into short cycles; the target's later layers write into the
# residual stream at PERTURB_GAIN, which sets how often they flip the draft's argmax.
EMBED_STD = 1.0
ATTN_GAIN = 2.0
MLP_GAIN = 1.5
LM_HEAD_GAIN = 4.0
PERTURB_GAIN = 0.075
SPECIAL_TOKEN_LOGIT_SCALE = 0.5


def _normal(generator: torch.Generator, shape: tuple[int, ...], std: float) -> torch.Tensor:
    return torch.randn(shape, generator=generator, dtype=torch.float32) * std


def _layer_weights(
    generator: torch.Generator, shape: TinyShape, index: int, out_scale: float
) -> dict[str, torch.Tensor]:
    hidden, kv_width = shape.hidden, shape.kv_heads * (shape.hidden // shape.heads)
    in_std = 1 / math.sqrt(hidden)
    prefix = f"model.layers.{index}."
    return {
        prefix + "input_layernorm.weight": torch.ones(hidden),
        prefix + "post_attention_layernorm.weight": torch.ones(hidden),
        prefix + "self_attn.q_proj.weight": _normal(generator, (hidden, hidden), ATTN_GAIN * in_std),
        prefix + "self_attn.q_proj.bias": _normal(generator, (hidden,), 0.1),
        prefix + "self_attn.k_proj.weight": _normal(generator, (kv_width, hidden), ATTN_GAIN * in_std),
        prefix + "self_attn.k_proj.bias": _normal(generator, (kv_width,), 0.1),
        prefix + "self_attn.v_proj.weight": _normal(generator, (kv_width, hidden), in_std),
        prefix + "self_attn.v_proj.bias": _normal(generator, (kv_width,), 0.1),
        prefix + "self_attn.o_proj.weight": _normal(
            generator, (hidden, hidden), out_scale * ATTN_GAIN / math.sqrt(hidden)
        ),
        prefix + "mlp.gate_proj.weight": _normal(generator, (shape.intermediate, hidden), MLP_GAIN * in_std),
        prefix + "mlp.up_proj.weight": _normal(generator, (shape.intermediate, hidden), in_std),
        prefix + "mlp.down_proj.weight": _normal(
            generator, (hidden, shape.intermediate), out_scale * MLP_GAIN / math.sqrt(shape.intermediate)
        ),
    }


def _random_weights(
    seed: int, shape: TinyShape, tokens: TokenizerInfo, perturb_from_layer: int
) -> dict[str, torch.Tensor]:
    """Layers at or past perturb_from_layer write into the residual stream at PERTURB_GAIN."""
    generator = torch.Generator().manual_seed(seed)
    embed = _normal(generator, (tokens.vocab_size, shape.hidden), EMBED_STD)
    lm_head = _normal(generator, (tokens.vocab_size, shape.hidden), LM_HEAD_GAIN / math.sqrt(shape.hidden))
    # Ids past the tokenizer get zero logits so greedy decoding never picks an undecodable token.
    lm_head[tokens.usable_vocab_size :] = 0.0
    # Special tokens stay reachable when sampling but rarely win greedily, so greedy runs are long.
    lm_head[list(tokens.special_ids)] *= SPECIAL_TOKEN_LOGIT_SCALE
    weights = {
        "model.embed_tokens.weight": embed,
        "model.norm.weight": torch.ones(shape.hidden),
        "lm_head.weight": lm_head,
    }
    for index in range(shape.layers):
        out_scale = PERTURB_GAIN if index >= perturb_from_layer else 1.0
        weights.update(_layer_weights(generator, shape, index, out_scale))
    return weights


def _draft_from_target(target: dict[str, torch.Tensor], draft_shape: TinyShape) -> dict[str, torch.Tensor]:
    kept_layers = {f"model.layers.{index}." for index in range(draft_shape.layers)}
    return {
        name: tensor.clone()
        for name, tensor in target.items()
        if not name.startswith("model.layers.") or any(name.startswith(prefix) for prefix in kept_layers)
    }


def _qwen2_config(shape: TinyShape, tokens: TokenizerInfo) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=tokens.vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=tokens.bos_token_id,
        eos_token_id=tokens.eos_token_id,
        pad_token_id=tokens.pad_token_id,
        dtype="float32",
    )


def _write_model(
    model_dir: Path, shape: TinyShape, tokens: TokenizerInfo, weights: dict[str, torch.Tensor]
) -> None:
    model_dir.mkdir(parents=True, exist_ok=True)
    _qwen2_config(shape, tokens).save_pretrained(str(model_dir))
    stop_ids = tokens.generation_eos_token_ids
    generation = GenerationConfig(
        bos_token_id=tokens.bos_token_id,
        eos_token_id=(stop_ids[0] if len(stop_ids) == 1 else list(stop_ids)) if stop_ids else None,
        pad_token_id=tokens.pad_token_id,
    )
    generation.save_pretrained(str(model_dir))
    contiguous = {name: tensor.contiguous() for name, tensor in weights.items()}
    weights_path = model_dir / "model.safetensors"
    save_file(contiguous, str(weights_path), metadata={"format": "pt"})
    weights_path.chmod(0o644)


def make_tiny(out_dir: Path, seed: int = 0, tokenizer_from: Path | None = None) -> TinyPair:
    """Write out_dir/{target,draft,draft_random}.

    tokenizer_from: a model dir whose tokenizer files and vocab size the three tiny models take over.
    """
    out_dir = Path(out_dir)
    pair = TinyPair(target=out_dir / "target", draft=out_dir / "draft", draft_random=out_dir / "draft_random")
    for model_dir in (pair.target, pair.draft, pair.draft_random):
        model_dir.mkdir(parents=True, exist_ok=True)
        for name in TOKENIZER_FILES:
            (model_dir / name).unlink(missing_ok=True)
    if tokenizer_from is None:
        tokenizer_files, tokens = write_byte_tokenizer(pair.target)
    else:
        tokenizer_files, tokens = copy_source_tokenizer(Path(tokenizer_from), pair.target)
    for model_dir in (pair.draft, pair.draft_random):
        for path in tokenizer_files:
            shutil.copyfile(path, model_dir / path.name)

    target_weights = _random_weights(2 * seed, TARGET_SHAPE, tokens, perturb_from_layer=DRAFT_SHAPE.layers)
    _write_model(pair.target, TARGET_SHAPE, tokens, target_weights)
    _write_model(pair.draft, DRAFT_SHAPE, tokens, _draft_from_target(target_weights, DRAFT_SHAPE))
    _write_model(
        pair.draft_random,
        DRAFT_SHAPE,
        tokens,
        _random_weights(2 * seed + 1, DRAFT_SHAPE, tokens, perturb_from_layer=DRAFT_SHAPE.layers),
    )
    return pair
