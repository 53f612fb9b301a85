"""Norms by torch's rms_norm (core.rms_norm): Hugging Face's values bit for bit in float32, within one bf16 step in
bf16; the loader swaps a Qwen2 model's norms on the fast path only, and a model so loaded still decodes Hugging Face's
greedy tokens in float32."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from tandem.core.rms_norm import RMSNorm, replace_norms
from tandem.models.loader import load_model

CPU = torch.device("cpu")


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = Qwen2RMSNorm(width, eps=1e-6)
        self.other = torch.nn.LayerNorm(width)  # another kind of norm: left alone


@pytest.mark.parametrize("shape", [(1, 1, 896), (3, 7, 64), (2, 40, 1536)])
@torch.no_grad()
def test_rms_norm_gives_hugging_faces_values(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    block = Block(shape[-1])
    block.norm.weight.copy_(torch.randn(shape[-1]) * 0.5 + 1)
    reference = Qwen2RMSNorm(shape[-1], eps=1e-6)
    reference.load_state_dict(block.norm.state_dict())
    assert replace_norms(block) == 1
    assert isinstance(block.norm, RMSNorm) and isinstance(block.other, torch.nn.LayerNorm)
    x = torch.randn(shape) * 3
    assert torch.equal(block.norm(x), reference(x))
    reference.to(torch.bfloat16)
    block.to(torch.bfloat16)
    ours, theirs = block.norm(x.bfloat16()), reference(x.bfloat16())
    assert ours.dtype == torch.bfloat16
    # One bf16 step at most: the weight is applied before the last rounding rather than after.
    step = theirs.float().abs() * 2**-7
    assert ((ours.float() - theirs.float()).abs() <= step + 1e-30).all()


def test_a_hooked_norm_is_left_as_it_is() -> None:
    block = Block(16)
    block.norm.register_forward_hook(lambda *args: None)
    assert replace_norms(block) == 0 and isinstance(block.norm, Qwen2RMSNorm)


@torch.no_grad()
def test_loader_swaps_norms_on_the_fast_path_and_greedy_tokens_stay_hugging_faces(tiny_dirs) -> None:
    fast = load_model(str(tiny_dirs.target), device=CPU, dtype=torch.float32, progress=False)
    eager = load_model(str(tiny_dirs.target), device=CPU, dtype=torch.float32, progress=False, eager=True)
    layers = fast.model.config.num_hidden_layers
    assert sum(isinstance(m, RMSNorm) for m in fast.model.modules()) == 2 * layers + 1
    assert not any(isinstance(m, RMSNorm) for m in eager.model.modules())
    prompt = torch.tensor([list(range(3, 20))])
    before = eager.model.generate(prompt, max_new_tokens=12, do_sample=False)
    assert replace_norms(eager.model) == 2 * layers + 1
    assert torch.equal(eager.model.generate(prompt, max_new_tokens=12, do_sample=False), before)
