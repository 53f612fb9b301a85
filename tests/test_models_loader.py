"""load_model / load_pair / check_compatible on tiny models written to tmp_path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from tandem.errors import IncompatibleModels, ModelNotFound
from tandem.models.loader import LoadedModel, check_compatible, load_model, load_pair
from tandem.models.source import check_spec

CPU = torch.device("cpu")


def byte_tokenizer(extra_tokens: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """Byte-level BPE over the 256 byte symbols, plus `extra_tokens` and an end-of-text token."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    for token in extra_tokens:
        vocab[token] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.add_special_tokens({"eos_token": "<|endoftext|>"})
    return tokenizer


def write_model(out_dir: Path, tokenizer: PreTrainedTokenizerFast, vocab_size: int | None = None) -> Path:
    config = Qwen2Config(
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def test_load_hf_directory(tmp_path: Path) -> None:
    model_dir = write_model(tmp_path / "m", byte_tokenizer())
    loaded = load_model(str(model_dir), device=CPU, dtype=torch.bfloat16, progress=False)

    assert loaded.spec == str(model_dir) and loaded.path == str(model_dir)
    assert not loaded.model.training
    assert loaded.model.dtype == torch.bfloat16
    # As from_pretrained leaves them: turning requires_grad off sends a strided LM-head matmul to a slow bf16 bmm.
    assert all(p.requires_grad for p in loaded.model.parameters())
    assert loaded.model.config._attn_implementation == "sdpa"
    ids = loaded.tokenizer("hi", return_tensors="pt").input_ids
    assert loaded.model(ids).logits.shape == (1, 2, len(loaded.tokenizer))


def test_load_gguf_file(tmp_path: Path) -> None:
    from models_pull_harness import write_tiny_gguf

    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf)
    loaded = load_model(str(gguf), device=CPU, dtype=torch.float32, progress=False)
    assert loaded.path == str(gguf)
    assert type(loaded.model).__name__ == "Qwen2ForCausalLM"
    assert loaded.model.dtype == torch.float32
    assert loaded.tokenizer.eos_token == "<|im_end|>"


def test_unknown_spec_lists_registry_names_and_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFound) as caught:
        load_model("no-such-org/no-such-model-xyz@" + "0" * 40, device=CPU, dtype=torch.float32)  # pinned
    message = str(caught.value)
    assert "no-such-org/no-such-model-xyz" in message
    assert "qwen2.5-coder-0.5b-instruct" in message and "qwen2.5-coder-1.5b-instruct" in message
    assert "config.json" in message and ".gguf" in message and "hub id" in message


def test_missing_path_and_pair_alias_are_not_models(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="no such file"):
        load_model(str(tmp_path / "absent.gguf"), device=CPU, dtype=torch.float32)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFound, match=r"no config\.json"):
        load_model(str(tmp_path / "empty"), device=CPU, dtype=torch.float32)
    with pytest.raises(ModelNotFound, match="pair"):
        load_model("qwen2.5-coder", device=CPU, dtype=torch.float32)


def test_check_spec_refuses_what_a_load_would_without_reading_a_model(tmp_path: Path) -> None:
    """check_spec: the same refusals as load_model above, and every accepted form passes, none of them loaded (an empty
    config.json and an empty .gguf file pass: only a load reads them; a hub id is left to the hub)."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("")
    (tmp_path / "weights.gguf").write_bytes(b"")
    (tmp_path / "weights.bin").write_bytes(b"")
    (tmp_path / "empty").mkdir()
    for accepted in ("qwen2.5-coder-1.5b-instruct", str(tmp_path / "model"), str(tmp_path / "weights.gguf"),
                     "org/name@" + "0" * 40, "org/name"):  # an unpinned id is refused later, by pin_spec
        check_spec(accepted)
    for refused, reason in ((str(tmp_path / "absent"), "no such file"), (str(tmp_path / "empty"), r"no config\.json"),
                            (str(tmp_path / "weights.bin"), r"not a \.gguf file"), ("qwen2.5-coder", "pair"),
                            ("no spaces allowed here", "not a registry name, a local path or a hub id")):
        with pytest.raises(ModelNotFound, match=reason):
            check_spec(refused)


def test_pair_sharing_a_tokenizer_loads(tmp_path: Path) -> None:
    draft_dir = write_model(tmp_path / "draft", byte_tokenizer())
    target_dir = write_model(tmp_path / "target", byte_tokenizer())
    draft, target = load_pair(str(draft_dir), str(target_dir), device=CPU, dtype=torch.float32)
    assert isinstance(draft, LoadedModel) and isinstance(target, LoadedModel)
    assert draft.spec == str(draft_dir) and target.spec == str(target_dir)


def test_different_tokenizers_are_incompatible(tmp_path: Path) -> None:
    draft_dir = write_model(tmp_path / "draft", byte_tokenizer(("ab",)))
    target_dir = write_model(tmp_path / "target", byte_tokenizer(("cd",)))
    with pytest.raises(IncompatibleModels) as caught:
        load_pair(str(draft_dir), str(target_dir), device=CPU, dtype=torch.float32, progress=False)
    message = str(caught.value)
    assert f"draft '{draft_dir}'" in message and f"target '{target_dir}'" in message
    assert "different tokenizers" in message


def test_larger_draft_vocabulary_is_incompatible(tmp_path: Path) -> None:
    tokenizer = byte_tokenizer()
    draft_dir = write_model(tmp_path / "d", tokenizer, vocab_size=320)
    draft = load_model(str(draft_dir), device=CPU, dtype=torch.float32)
    target = load_model(str(write_model(tmp_path / "t", tokenizer)), device=CPU, dtype=torch.float32)
    with pytest.raises(IncompatibleModels, match=r"larger output vocabulary \(320\)"):
        check_compatible(draft, target)
    check_compatible(target, draft)
