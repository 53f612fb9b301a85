"""Prepacked oneDNN linears (core.packed_linear): the same numbers as nn.Linear in bf16, and only where they apply."""

from __future__ import annotations

import pytest
import torch

from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.core.packed_linear import PackedLinear, packable, prepack, supported, weight_bytes
from tandem.core.runner import ModelRunner
from tandem.engines.local import build_engine
from tandem.models.loader import load_model

CPU = torch.device("cpu")
needs_packing = pytest.mark.skipif(not supported(), reason="oneDNN cannot pack bf16 weights on this CPU (AVX2 only)")


def load(path, dtype: torch.dtype = torch.bfloat16, eager: bool = False):
    return load_model(str(path), device=CPU, dtype=dtype, progress=False, eager=eager)


def linears(model: torch.nn.Module, kind: type) -> int:
    return sum(type(module) is kind for module in model.modules())


@needs_packing
def test_packed_linear_matches_nn_linear_bit_for_bit() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 80, bias=True).to(torch.bfloat16)
    packed = PackedLinear.from_linear(linear)
    with torch.no_grad():
        for shape in ((1, 48), (3, 1, 48), (2, 7, 48)):
            x = torch.randn(shape, dtype=torch.bfloat16)
            assert torch.equal(packed(x), linear(x))
        head = packed.first_rows(30)
        x = torch.randn(2, 3, 48, dtype=torch.bfloat16)
        assert torch.equal(head(x), linear(x)[..., :30])


@needs_packing
def test_loader_packs_bf16_on_cpu_only(tiny_dirs) -> None:
    fast, eager = load(tiny_dirs.target), load(tiny_dirs.target, eager=True)
    full = load(tiny_dirs.target, torch.float32)
    assert linears(fast.model, torch.nn.Linear) == 0 and linears(fast.model, PackedLinear) > 0
    assert linears(eager.model, PackedLinear) == 0 and linears(full.model, PackedLinear) == 0
    assert not packable(full.model)
    assert weight_bytes(fast.model) == weight_bytes(eager.model) > 0
    assert prepack(fast.model) == 0  # already packed: a second call changes nothing
    # The tied embedding keeps its plain weight for lookups; the head is a packed copy of it.
    assert isinstance(fast.model.get_output_embeddings(), PackedLinear)
    assert fast.model.get_input_embeddings().weight.dtype == torch.bfloat16


@needs_packing
def test_packed_model_logits_equal_eager_in_runner_and_generate(tiny_dirs) -> None:
    fast, eager = load(tiny_dirs.target), load(tiny_dirs.target, eager=True)
    prompt = list(range(3, 40))
    logits = []
    for loaded in (fast, eager):
        runner = ModelRunner(loaded.model, kv_tokens=512)
        state = runner.state("a")
        state.sync(0, prompt)
        logits.append(runner.forward([state], [5])[0])
    assert torch.equal(logits[0], logits[1])
    ids = torch.tensor([prompt])
    outs = [loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                  pad_token_id=0) for loaded in (fast, eager)]
    assert torch.equal(outs[0], outs[1])


@needs_packing
def test_packed_draft_head_scores_part_of_the_vocabulary(tiny_dirs) -> None:
    fast, eager = load(tiny_dirs.draft), load(tiny_dirs.draft, eager=True)
    results = []
    for loaded in (fast, eager):
        runner = ModelRunner(loaded.model, kv_tokens=512, vocab_limit=50)
        state = runner.state("a")
        state.sync(0, list(range(3, 20)))
        results.append(runner.forward([state], [2])[0])
    assert results[0].shape[-1] == 50 and torch.equal(results[0], results[1])


@needs_packing
def test_speculative_engine_on_packed_models_equals_plain_greedy(tiny_dirs) -> None:
    target, draft = load(tiny_dirs.target), load(tiny_dirs.draft)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 30)]
    outputs = {}
    for name, spec in (("plain", SpecConfig(enabled=False)), ("spec", SpecConfig(k_max=4, k_init=4, adaptive=False))):
        engine = build_engine(target, draft if spec.enabled else None, EngineConfig(spec=spec, calibrate=False))
        outputs[name] = [result.token_ids for result in engine.generate(prompts, params)]  # one batch
    assert outputs["spec"] == outputs["plain"]


def test_models_stay_eager_where_the_cpu_cannot_pack() -> None:
    """Not skipped with the rest: on a CPU oneDNN cannot pack bf16 for, the loader must leave the linears alone."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 16)).to(torch.bfloat16)
    assert packable(model) == supported()
    assert prepack(model) == (1 if supported() else 0)
