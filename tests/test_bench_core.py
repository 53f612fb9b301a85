"""The bench's Hugging Face methods: plain greedy like tandem's runners, on models as from_pretrained leaves them
(parameters requiring grad: turning that off sent HF's sliced LM-head matmul to a bmm that copies the head weight);
and the prompts every benchmark's `--prompts` names."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from tandem.bench.core import HF_ASSISTANT, hf_generate, run_bench
from tandem.bench.prompts import DEFAULT_PROMPTS, PROMPT_SETS, load_prompts
from tandem.core.config import EngineConfig, SamplingParams
from tandem.engines.local import build_engine, encode_prompt
from tandem.errors import InvalidArgument


def test_prompts_name_a_shipped_set_or_a_jsonl_file(tmp_path) -> None:
    assert DEFAULT_PROMPTS in PROMPT_SETS and load_prompts() == load_prompts(DEFAULT_PROMPTS)
    assert len(load_prompts("bench")) == 8 and all(isinstance(p, str) and p for p in load_prompts("bench"))
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "def add(a, b):"}\n\n{"prompt": "Sort a list"}\n')
    assert load_prompts(str(path)) == load_prompts(path) == ["def add(a, b):", "Sort a list"]
    with pytest.raises(InvalidArgument, match="neither a shipped set"):
        load_prompts("no-such-set")
    path.write_text('{"text": "x"}\n')
    with pytest.raises(InvalidArgument, match="line 1"):
        load_prompts(path)


def _requires_grad(model) -> set[bool]:
    return {p.requires_grad for p in model.parameters()}


def test_hf_assisted_uses_the_assistant_settings_and_restores_them(tiny_models) -> None:
    target, draft, _ = tiny_models
    assert _requires_grad(target.model) == _requires_grad(draft.model) == {True}  # as from_pretrained leaves them
    before = {key: getattr(draft.model.generation_config, key, None) for key in HF_ASSISTANT}
    schedules: list[str] = []
    hook = draft.model.register_forward_pre_hook(
        lambda module, args: schedules.append(module.generation_config.num_assistant_tokens_schedule))
    try:
        hf_generate(target, draft, encode_prompt(target.tokenizer, "def add(a, b):", chat=False), 6)
    finally:
        hook.remove()
    assert schedules and set(schedules) == {HF_ASSISTANT["num_assistant_tokens_schedule"]}
    assert {key: getattr(draft.model.generation_config, key, None) for key in HF_ASSISTANT} == before


def test_sliced_head_matmul_folds_into_mm(tiny_models) -> None:
    """A loaded model's 2-token forward that keeps 1 logit (every assistant round's first forward) runs its head as
    one mm, not a bmm that copies the head weight."""
    target, _, _ = tiny_models
    ids = torch.tensor([encode_prompt(target.tokenizer, "def add(a, b):", chat=False)[:2]])
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        target.model(input_ids=ids, logits_to_keep=1)
    assert not [e for e in prof.events() if e.name == "aten::bmm"]


def test_hf_methods_match_tandem_plain_greedy(tiny_models) -> None:
    target, draft, _ = tiny_models
    engine = build_engine(target, None, EngineConfig(calibrate=False))
    for prompt in ("def add(a, b):", "Write a loop"):
        ids = encode_prompt(target.tokenizer, prompt, chat=False)
        plain = engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=12))[0].token_ids
        assert hf_generate(target, None, ids, 12) == plain
        assert hf_generate(target, draft, ids, 12) == plain


def test_report_says_how_hf_was_loaded_and_called(tiny_models) -> None:
    target, draft, _ = tiny_models
    report = run_bench(target, draft, ["def add(a, b):"], 6, progress=False)
    for key in ("plain", "hf_plain", "hf_assisted", "tandem"):
        assert report[key]["tokens"] > 0
    hf = report["config"]["hf"]
    assert "from_pretrained" in hf["load"] and "float32" in hf["load"] and "assistant_model" in hf["call"]
    assert set(hf["assistant"]) == {"num_assistant_tokens", "num_assistant_tokens_schedule",
                                    "assistant_confidence_threshold", "threshold_adapts"}
    assert hf["assistant"]["num_assistant_tokens_schedule"] == HF_ASSISTANT["num_assistant_tokens_schedule"]
    assert report["hf_assisted_vs_hf_plain"] > 0 and report["hf_plain_vs_plain"] > 0
    assert report["greedy_identical_to_hf_plain"] == "1/1"


def test_bench_reports_weight_bandwidth_and_runs_hf_on_standard_models(tiny_dirs) -> None:
    """bf16 on CPU: tandem's models are prepacked, Hugging Face's methods run on a standard copy, and every method
    reports the bytes of weights it read per second."""
    from tandem.core.packed_linear import PackedLinear, weight_bytes
    from tandem.models.loader import load_model

    def load(path, eager: bool):
        return load_model(str(path), device=torch.device("cpu"), dtype=torch.bfloat16, progress=False, eager=eager)

    target, draft = load(tiny_dirs.target, False), load(tiny_dirs.draft, False)
    standard = load(tiny_dirs.target, True), load(tiny_dirs.draft, True)
    assert not any(isinstance(m, PackedLinear) for loaded in standard for m in loaded.model.modules())
    calls = []
    hook = standard[0].model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        report = run_bench(target, draft, ["def add(a, b):"], 6, progress=False, hf_models=standard)
    finally:
        hook.remove()
    assert calls  # the hf methods ran on the standard target
    assert report["config"]["hf"]["own_models"] is True
    assert report["config"]["target_weight_bytes"] == weight_bytes(target.model) > 0
    for method in ("plain", "hf_plain"):
        expected = report[method]["tokens"] * weight_bytes(target.model) / report[method]["seconds"] / 1e9
        assert abs(report[method]["weight_gb_s"] - expected) <= 0.01 + 1e-3 * expected
    assert report["tandem"]["weight_gb_s"] > 0
