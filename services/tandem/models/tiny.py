"""Tiny, deterministic Qwen2-architecture models for tests and benchmarks.

make_tiny writes a target, a draft built to agree with the target's greedy choice most of the time,
and an unrelated random draft, all sharing one tokenizer.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
DEFAULT_MODEL_VOCAB_SIZE = 320

# ChatML, with tools and tool calls rendered in Qwen2.5's way (a chat without them renders as plain ChatML).
CHATML_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": '"
    " + (call.function.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# transformers loads every qwen2-type tokenizer through Qwen2Tokenizer, which imposes NFC and this split
# regex; the saved tokenizer.json uses the same pipeline so raw `tokenizers` users see identical ids.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


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


@dataclass(slots=True, frozen=True)
class TokenizerInfo:
    vocab_size: int
    usable_vocab_size: int
    special_ids: tuple[int, ...]
    eos_token_id: int | None
    bos_token_id: int | None
    pad_token_id: int | None
    # generation_config may stop on several ids (Qwen instruct models stop on <|im_end|> and <|endoftext|>).
    generation_eos_token_ids: tuple[int, ...]


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    byte_chars.sort()
    vocab = {char: index for index, char in enumerate(byte_chars)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(token, special=True) for token in (ENDOFTEXT, IM_START, IM_END)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        extra_special_tokens=[IM_START, IM_END],
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )


def _write_default_tokenizer(out_dir: Path) -> tuple[list[Path], TokenizerInfo]:
    tokenizer = build_byte_tokenizer()
    saved = [Path(name) for name in tokenizer.save_pretrained(str(out_dir))]
    endoftext_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    info = TokenizerInfo(
        vocab_size=DEFAULT_MODEL_VOCAB_SIZE,
        usable_vocab_size=len(tokenizer),
        special_ids=tuple(tokenizer.convert_tokens_to_ids([ENDOFTEXT, IM_START, IM_END])),
        eos_token_id=endoftext_id,
        bos_token_id=endoftext_id,
        pad_token_id=endoftext_id,
        generation_eos_token_ids=(endoftext_id,),
    )
    return [path for path in saved if path.is_file()], info


def _token_ids(value: object) -> tuple[int, ...]:
    if isinstance(value, list):
        return tuple(int(token_id) for token_id in value)
    return (int(value),) if isinstance(value, int) else ()


def _first_id(value: object) -> int | None:
    return next(iter(_token_ids(value)), None)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _copy_source_tokenizer(source: Path, out_dir: Path) -> tuple[list[Path], TokenizerInfo]:
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out_dir / name)
            copied.append(out_dir / name)
    if not any(path.name == "tokenizer.json" for path in copied):
        raise FileNotFoundError(f"{source} has no tokenizer.json to copy")
    source_config = _read_json(source / "config.json")
    source_generation = _read_json(source / "generation_config.json")
    usable = Tokenizer.from_file(str(source / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    generation_eos = _token_ids(source_generation.get("eos_token_id", source_config.get("eos_token_id")))
    eos = _first_id(source_config.get("eos_token_id", list(generation_eos)))
    info = TokenizerInfo(
        vocab_size=max(int(source_config.get("vocab_size", usable)), usable),
        usable_vocab_size=usable,
        special_ids=(),
        eos_token_id=eos,
        bos_token_id=_first_id(source_generation.get("bos_token_id", source_config.get("bos_token_id"))),
        pad_token_id=_first_id(source_generation.get("pad_token_id", source_config.get("pad_token_id", eos))),
        generation_eos_token_ids=generation_eos or (() if eos is None else (eos,)),
    )
    return copied, info


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
        tokenizer_files, tokens = _write_default_tokenizer(pair.target)
    else:
        tokenizer_files, tokens = _copy_source_tokenizer(Path(tokenizer_from), pair.target)
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
