from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from tandem.core.kv_cache import cache_keyword
from tandem.models.tiny import TinyPair, make_tiny
from tandem.models.tiny_tokenizer import IM_END, IM_START, TOKENIZER_FILES, build_byte_tokenizer

PROMPT_COUNT = 8
PROMPT_LENGTH = 8
GREEDY_STEPS = 64


@dataclass(slots=True, frozen=True)
class LoadedPair:
    target: PreTrainedModel
    draft: PreTrainedModel
    draft_random: PreTrainedModel


def _file_hashes(root: Path) -> dict[str, str]:
    return {
        path.relative_to(root).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def _load(model_dir: Path) -> PreTrainedModel:
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    return model.eval()


@pytest.fixture(scope="module", autouse=True)
def single_thread() -> Iterator[None]:
    """Tiny models run far faster on one thread, and do not stall when other processes hold the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> TinyPair:
    return make_tiny(tmp_path_factory.mktemp("tiny") / "seed0", seed=0)


@pytest.fixture(scope="module")
def loaded(pair: TinyPair) -> LoadedPair:
    return LoadedPair(_load(pair.target), _load(pair.draft), _load(pair.draft_random))


@pytest.fixture(scope="module")
def greedy_sequences(loaded: LoadedPair) -> torch.Tensor:
    """Target-greedy continuations of random byte prompts, one row per prompt."""
    generator = torch.Generator().manual_seed(1234)
    sequences = torch.randint(0, 256, (PROMPT_COUNT, PROMPT_LENGTH), generator=generator)
    keyword = cache_keyword(loaded.target)  # `cache` from transformers 5.24, `past_key_values` before
    with torch.no_grad():
        output = loaded.target(sequences, use_cache=True)
        for _ in range(GREEDY_STEPS):
            next_tokens = output.logits[:, -1].argmax(-1, keepdim=True)
            sequences = torch.cat([sequences, next_tokens], dim=1)
            output = loaded.target(next_tokens, use_cache=True, **{keyword: getattr(output, keyword)})
    return sequences


def _next_token_logits(model: PreTrainedModel, sequences: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(sequences).logits[:, PROMPT_LENGTH - 1 : -1]


def test_same_seed_gives_identical_files_and_other_seeds_differ(pair: TinyPair, tmp_path: Path) -> None:
    original = _file_hashes(pair.target.parent)
    again = _file_hashes(make_tiny(tmp_path / "again", seed=0).target.parent)
    other = _file_hashes(make_tiny(tmp_path / "other", seed=1).target.parent)
    assert {"target/model.safetensors", "draft/tokenizer.json", "draft_random/config.json"} <= set(original)
    assert again == original
    for role in ("target", "draft", "draft_random"):
        assert other[f"{role}/model.safetensors"] != original[f"{role}/model.safetensors"]
    assert original["draft/model.safetensors"] != original["draft_random/model.safetensors"]


def test_models_load_fast_and_target_costs_more(pair: TinyPair) -> None:
    _load(pair.draft_random)  # first load imports the modeling code
    started = time.perf_counter()
    target, draft = _load(pair.target), _load(pair.draft)
    AutoTokenizer.from_pretrained(pair.target)
    assert time.perf_counter() - started < 3.0
    assert target.config.num_hidden_layers > draft.config.num_hidden_layers
    target_parameters = sum(parameter.numel() for parameter in target.model.layers.parameters())
    draft_parameters = sum(parameter.numel() for parameter in draft.model.layers.parameters())
    assert target_parameters >= 3 * draft_parameters


def test_every_directory_carries_the_same_tokenizer(pair: TinyPair) -> None:
    target_files = {name for name in TOKENIZER_FILES if (pair.target / name).is_file()}
    assert "tokenizer.json" in target_files
    for model_dir in (pair.draft, pair.draft_random):
        for name in target_files:
            assert (model_dir / name).read_bytes() == (pair.target / name).read_bytes()


def test_draft_agrees_with_target_greedy_and_random_draft_does_not(
    loaded: LoadedPair, greedy_sequences: torch.Tensor
) -> None:
    target_logits = _next_token_logits(loaded.target, greedy_sequences)
    target_choice = target_logits.argmax(-1)
    assert torch.equal(target_choice, greedy_sequences[:, PROMPT_LENGTH:])
    target_probs = target_logits.softmax(-1)
    for draft, low, high in ((loaded.draft, 0.6, 0.95), (loaded.draft_random, 0.0, 0.1)):
        draft_logits = _next_token_logits(draft, greedy_sequences)
        agreement = (draft_logits.argmax(-1) == target_choice).float().mean().item()
        overlap = torch.minimum(target_probs, draft_logits.softmax(-1)).sum(-1).mean().item()
        assert low <= agreement <= high
        assert low <= overlap <= high


def test_target_greedy_continuations_are_not_degenerate(greedy_sequences: torch.Tensor) -> None:
    continuations = greedy_sequences[:, PROMPT_LENGTH:].tolist()
    assert len({tuple(tokens) for tokens in continuations}) == PROMPT_COUNT
    for tokens in continuations:
        assert len(set(tokens)) >= GREEDY_STEPS // 3
        assert len(set(tokens[-16:])) >= 8


def test_tokenizer_round_trips_utf8(pair: TinyPair) -> None:
    tokenizer = AutoTokenizer.from_pretrained(pair.target)
    raw = Tokenizer.from_file(str(pair.target / "tokenizer.json"))
    for text in ("héllo → 世界 🙂", "  tabs\tand\r\nnewlines  ", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑ x² ≠ 0", "don't 123,456.7"):
        ids = tokenizer(text, add_special_tokens=False).input_ids
        assert len(ids) == len(text.encode("utf-8"))
        assert all(token_id < 256 for token_id in ids)
        assert ids == raw.encode(text, add_special_tokens=False).ids
        assert tokenizer.decode(ids) == text
    emoji_ids = tokenizer("🙂", add_special_tokens=False).input_ids
    assert len(emoji_ids) == 4
    assert tokenizer.decode(emoji_ids[:2]) + tokenizer.decode(emoji_ids[2:]) != "🙂"
    assert tokenizer.decode(emoji_ids) == "🙂"


def test_chat_template_and_special_tokens(pair: TinyPair, loaded: LoadedPair) -> None:
    tokenizer = AutoTokenizer.from_pretrained(pair.draft)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi 🙂"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        f"{IM_START}system\nbe brief{IM_END}\n{IM_START}user\nhi 🙂{IM_END}\n{IM_START}assistant\n"
    )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids == tokenizer(text, add_special_tokens=False).input_ids
    im_start_id, im_end_id = tokenizer.convert_tokens_to_ids([IM_START, IM_END])
    assert ids.count(im_start_id) == 3 and ids.count(im_end_id) == 2
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.pad_token_id == tokenizer.eos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "system\nbe brief\nuser\nhi 🙂\nassistant\n"
    for model in (loaded.target, loaded.draft, loaded.draft_random):
        assert model.config.eos_token_id == tokenizer.eos_token_id
        assert model.generation_config.eos_token_id == tokenizer.eos_token_id
        assert model.config.vocab_size >= len(tokenizer)


def test_tokenizer_from_copies_source_tokenizer_and_vocab_size(tmp_path: Path) -> None:
    source = tmp_path / "source"
    source_tokenizer = build_byte_tokenizer()
    source_tokenizer.add_tokens(["<|tool|>"], special_tokens=True)
    source_tokenizer.save_pretrained(str(source))
    tool_id = source_tokenizer.convert_tokens_to_ids("<|tool|>")
    (source / "config.json").write_text(json.dumps({"vocab_size": 300, "eos_token_id": 256}))

    pair = make_tiny(tmp_path / "out", seed=3, tokenizer_from=source)
    source_json = (source / "tokenizer.json").read_bytes()
    for model_dir in (pair.target, pair.draft, pair.draft_random):
        assert (model_dir / "tokenizer.json").read_bytes() == source_json
        config = json.loads((model_dir / "config.json").read_text())
        assert config["vocab_size"] == 300 and config["eos_token_id"] == 256
    tokenizer = AutoTokenizer.from_pretrained(pair.draft_random)
    assert tokenizer.convert_tokens_to_ids("<|tool|>") == tool_id
    draft = _load(pair.draft_random)
    assert draft.get_input_embeddings().weight.shape[0] == 300
    assert torch.all(draft.lm_head.weight[len(tokenizer) :] == 0)
