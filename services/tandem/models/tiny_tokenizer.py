"""The tokenizer the tiny models share (models.tiny): a byte-level BPE tokenizer with ChatML's special tokens and
Qwen2's pre-tokenizer, written out, or another model's tokenizer files copied; either way with what the models'
configs take from it (TokenizerInfo).

A module of its own, apart from the weights, so that what only tokenizes (the detokenizer and stop tests, the detok
benchmark) imports neither torch nor safetensors.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

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


def write_byte_tokenizer(out_dir: Path) -> tuple[list[Path], TokenizerInfo]:
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


def copy_source_tokenizer(source: Path, out_dir: Path) -> tuple[list[Path], TokenizerInfo]:
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
