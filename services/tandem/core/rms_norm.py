"""RMSNorm as torch's one `rms_norm` call rather than Hugging Face's chain of small ops.

Hugging Face's Llama-family RMSNorm (Qwen2's among them) runs eight ops a call: a cast to float32, pow, mean, add,
rsqrt, mul, a cast back and the weight's mul. In a decode step every one of them runs right after a matrix product
has streamed its weights through the caches, so each pays its dispatch on cold caches: in place, the 1.5B target's
57 norms took 6.0 ms of a 161 ms forward at one row (105 us each, against 19 us on warm caches; CPU-A, 2 threads,
docs/performance.md). torch.nn.functional.rms_norm computes the same normalization in fewer ops (on a CPU its
composite `_fused_rms_norm`; on a GPU one kernel) and saved 3.9 ms of that forward.

In float32 it gives Hugging Face's values bit for bit (the same operations in the same order). In bf16 it applies the
weight before the last rounding where Hugging Face rounds first, so an output can differ by one bf16 step: as fused
projections do (core.fused_linear), every path of a loaded model runs the same layers, so verification is unchanged.

Only the classes listed here are replaced: other models' norms may compute something else under the same name
(Gemma's multiplies by 1 + weight).
"""

from __future__ import annotations

import torch

# Hugging Face classes whose forward is weight * (x * rsqrt(mean(x^2) + variance_epsilon)) in float32, cast back.
SAME_FORMULA = frozenset({"Qwen2RMSNorm", "Qwen3RMSNorm", "LlamaRMSNorm", "MistralRMSNorm"})


class RMSNorm(torch.nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps) over the last dimension, by torch's rms_norm; inference only."""

    def __init__(self, weight: torch.nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.eps = eps
        self.shape = (weight.shape[0],)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(hidden_states, self.shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.shape[0]}, eps={self.eps}"


def replace_norms(model: torch.nn.Module) -> int:
    """Swap every SAME_FORMULA norm of `model` for an RMSNorm over the same weight, in place; the number swapped. A
    norm with hooks (a parallel plan's) stays as it is."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            hooked = child._forward_hooks or child._forward_pre_hooks
            if type(child).__name__ in SAME_FORMULA and getattr(child, "weight", None) is not None and not hooked:
                setattr(parent, name, RMSNorm(child.weight, float(child.variance_epsilon)))
                replaced += 1
    return replaced
