"""core.cpu_attention's kernel against PyTorch's sdpa, attention alone, as a decode step calls it: the query heads
stacked per key/value head (core.attention), keys and values views of a larger cache, each row a few tokens shorter
than the last, a causal mask over the row's new tokens. One call per layer over the model's layers, each layer's
own cache, and a 48 MiB buffer written between calls so that keys and values come from memory, as they do after a
layer's weights have streamed through the caches. Per shape (the target's 12/2/128 heads and dim, the draft's 14/2/64),
rows, width and cached length: the median over ROUNDS of the layers' summed time, the arms alternated each round,
and each arm's largest error against float32 attention over the same bf16 inputs.

    PYTHONPATH=services python docs/bench/cpu-attention-kernel-v1.py ROUNDS OUT.json [ARMS]   # about 3 min on CPU-A

ARMS, comma-separated (default sdpa,kernel): sdpa; kernel (core.cpu_attention as it is); kernel_f32 (its scores by
float32 multiply-adds, not AVX512-BF16 dot products); kernel@COMMIT (csrc/decode_attention.cpp as git has it at
COMMIT, built beside it as the op tandem_at_COMMIT::decode_attention, for a before and after in one process). Each
ratio in the JSON is an arm's time over sdpa's.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tandem.core import cpu_attention, cpu_kernels

SHAPES = {"target": (12, 2, 128, 28), "draft": (14, 2, 64, 24)}  # query heads, kv heads, dim, layers
CASES = [(1, 1, 301), (8, 1, 301), (8, 2, 301), (8, 3, 301), (8, 5, 301), (8, 9, 301), (8, 1, 700), (1, 9, 301)]


def arm_call(name: str, query: torch.Tensor, mask: torch.Tensor, scale: float):
    if name == "sdpa":
        return lambda k, v: torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale)
    if name in ("kernel", "kernel_f32"):
        bf16_dot = None if name == "kernel" else False
        return lambda k, v: cpu_attention.decode_attention(query, k, v, mask, scale, bf16_dot=bf16_dot)
    op = getattr(torch.ops, f"tandem_at_{name.split('@')[1]}").decode_attention
    return lambda k, v: op(query, k, v, mask, scale)


def build_at(commit: str) -> None:
    """The kernel's source at `commit`, built as the op tandem_at_COMMIT::decode_attention (its schema then: no
    bf16_dot argument)."""
    from torch.utils.cpp_extension import load

    source = subprocess.run(["git", "show", f"{commit}:services/tandem/core/csrc/decode_attention.cpp"],
                            check=True, capture_output=True, text=True).stdout
    namespace = f"tandem_at_{commit}"
    torch.library.define(f"{namespace}::decode_attention",
                         "(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor")
    directory = Path(tempfile.mkdtemp(prefix=namespace))
    renamed = source.replace("TORCH_LIBRARY_IMPL(tandem,", f"TORCH_LIBRARY_IMPL({namespace},")
    (directory / "kernel.cpp").write_text(renamed)
    load(namespace, [str(directory / "kernel.cpp")], build_directory=str(directory), is_python_module=False,
         extra_cflags=list(cpu_kernels.CFLAGS + cpu_kernels.AVX512), extra_ldflags=list(cpu_kernels.LDFLAGS))


def case(heads: int, kv_heads: int, dim: int, layers: int, rows: int, width: int, length: int, rounds: int,
         names: list[str]) -> dict:
    groups, capacity = heads // kv_heads, 1024
    caches = [torch.randn(2, rows, kv_heads, capacity, dim).bfloat16() for _ in range(layers)]
    query = torch.randn(rows, kv_heads, groups * width, dim).bfloat16()
    mask = torch.zeros(rows, 1, width, length, dtype=torch.bool)
    for row in range(rows):
        for j in range(width):
            mask[row, 0, j, : length - 3 * row - width + 1 + j] = True
    mask = mask.unsqueeze(2).expand(-1, -1, groups, -1, -1).reshape(rows, 1, groups * width, length)
    if width == 1:
        mask = mask[:, :, :1]
    scale, flush = 1 / math.sqrt(dim), torch.empty(48 * 2**20, dtype=torch.uint8)
    arms = {name: arm_call(name, query, mask, scale) for name in names}
    key, value = caches[0][0, :, :, :length], caches[0][1, :, :, :length]
    want = torch.nn.functional.scaled_dot_product_attention(query.float(), key.float(), value.float(),
                                                            attn_mask=mask, scale=scale)
    errors = {name: (arm(key, value).float() - want).abs().max().item() for name, arm in arms.items()}
    times: dict[str, list[float]] = {name: [] for name in arms}
    for round_ in range(rounds + 1):
        for name in list(arms)[:: 1 if round_ % 2 == 0 else -1]:
            total = 0.0
            for cache in caches:
                flush.add_(1)
                started = time.perf_counter()
                arms[name](cache[0, :, :, :length], cache[1, :, :, :length])
                total += time.perf_counter() - started
            if round_:  # the first round warms up
                times[name].append(total)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return {"rows": rows, "width": width, "length": length, "queries_per_task": groups * width,
            "ms_per_forward": {name: round(m, 3) for name, m in ms.items()},
            **{f"{name}_over_sdpa": round(m / ms["sdpa"], 3) for name, m in ms.items() if name != "sdpa"},
            "max_error": {name: float(f"{e:.3g}") for name, e in errors.items()}}


def main(rounds: int, out: str, names: list[str]) -> None:
    torch.set_num_threads(2)
    assert cpu_attention.ready(), "the kernel does not run on this machine"
    for name in names:
        if "@" in name:
            build_at(name.split("@")[1])
    report = {"rounds": rounds, "threads": 2, "torch": torch.__version__, "arms": names,
              "bf16_dot": cpu_attention.BF16_DOT, "shapes": {}}
    with torch.inference_mode():
        for name, (heads, kv_heads, dim, layers) in SHAPES.items():
            report["shapes"][name] = []
            for rows, width, length in CASES:
                result = case(heads, kv_heads, dim, layers, rows, width, length, rounds, names)
                report["shapes"][name].append(result)
                print(name, json.dumps(result), flush=True)
    with open(out, "w") as sink:
        json.dump(report, sink, indent=1)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3].split(",") if len(sys.argv) > 3 else ["sdpa", "kernel"])
