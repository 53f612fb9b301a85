"""scripts/gpu_probe.py runs only where CUDA is; its measuring functions run here on tiny shapes, so a GPU session
does not spend its machine time on a probe that breaks."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

SPEC = importlib.util.spec_from_file_location("gpu_probe", Path(__file__).parents[1] / "scripts" / "gpu_probe.py")
probe = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(probe)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512)


def test_probe_measures_tandem_and_hugging_face_on_the_same_weights() -> None:
    cpu = torch.device("cpu")
    target, draft = probe.build("target", cpu, torch.float32, **TINY), probe.build("draft", cpu, torch.float32, **TINY)
    work = probe.prompts(3, vocab=500)
    plain = probe.run_tandem(target, draft, None, 1, work, 8)
    spec = probe.run_tandem(target, draft, 2, 2, work, 8)
    assert plain["tokens"] == spec["tokens"] == 24 and spec["drafted"] > 0
    assert probe.hf_generate(target, work[:2], 2, 8)["tokens"] == 16
    costs = probe.forward_costs(probe.ModelRunner(target), [1, 3], context=64, reps=2)
    assert set(costs) == {1, 3} and all(seconds > 0 for seconds in costs.values())
    head_dim = 64 // 4
    assert probe.kv_bytes_per_token(target) == 2 * 2 * 2 * head_dim * 4  # layers x (k, v) x kv heads x dim x fp32
