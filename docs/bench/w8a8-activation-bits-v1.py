"""Draft acceptance with w8a8 activations at 8 bits and at 7 bits, against the draft as loaded: one sitting.

On a CPU without VNNI, core.w8a8_linear quantizes activations to 7 bits (levels -63..63), since oneDNN's AVX2 kernel
saturates 8-bit sums (activation_levels). What that costs is acceptance: greedy, batch 1, k fixed at 4 (so every
round drafts, whatever the costs), the chat-templated prompts one by one. Variants: the draft as loaded; w8a8 at
this CPU's levels (oneDNN); w8a8 at 127 and at 63 levels emulated in float32 (each row quantized to its levels, times
the layer's own int8 weights dequantized), which runs on any CPU. Every output must equal plain decoding's.

    PYTHONPATH=services python docs/bench/w8a8-activation-bits-v1.py 3 32 out.json
"""

import json
import sys
import time

import torch

from tandem.bench.prompts import load_prompts
from tandem.core import w8a8_linear
from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.engines.local import build_engine, encode_prompt
from tandem.models.loader import load_model

torch.set_num_threads(2)
num_prompts, max_tokens, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
cpu = torch.device("cpu")


def emulate(model: torch.nn.Module, top: int) -> None:
    """Each W8A8Linear of `model` computes in float32 at levels -top..top: the layer's own quantizing
    (w8a8_linear._product) around a float product of the levels by its dequantized weight, in place of oneDNN's."""
    for layer in model.modules():
        if isinstance(layer, w8a8_linear.W8A8Linear):
            weight = layer.dequantized()

            def gemm(levels, packed, scale, zero_points, offset, weight=weight):
                return (levels.float() - offset) @ weight.t()

            def forward(x, layer=layer, gemm=gemm):
                return w8a8_linear._product(x, gemm, None, layer.scale, layer.zero_points, layer.bias, top)
            layer.forward = forward


target = load_model("qwen2.5-coder-1.5b-instruct", device=cpu, dtype=torch.bfloat16, progress=False)
drafts = {"bf16": load_model("qwen2.5-coder-0.5b-instruct", device=cpu, dtype=torch.bfloat16, progress=False)}
for name in ("w8a8_kernel", "w8a8_emulated_127", "w8a8_emulated_63"):
    drafts[name] = load_model("qwen2.5-coder-0.5b-instruct", device=cpu, dtype=torch.bfloat16, progress=False,
                              quantization="w8a8")
emulate(drafts["w8a8_emulated_127"].model, 127)
emulate(drafts["w8a8_emulated_63"].model, 63)
fixed = EngineConfig(max_batch=1, calibrate=False, spec=SpecConfig(adaptive=False, k_init=4, k_max=4))
engines = {"plain": build_engine(target, None, EngineConfig(max_batch=1, calibrate=False,
                                                            spec=SpecConfig(enabled=False)))}
engines |= {name: build_engine(target, draft, fixed) for name, draft in drafts.items()}
prompts = [encode_prompt(target.tokenizer, text, chat=True) for text in load_prompts(None)[:num_prompts]]
greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
runs = {name: {"drafted": 0, "accepted": 0, "seconds": 0.0, "outputs": []} for name in engines}
names = list(engines)
for i, ids in enumerate(prompts):
    for name in names[i % len(names):] + names[: i % len(names)]:
        started = time.perf_counter()
        result = engines[name].generate([ids], greedy)[0]
        runs[name]["seconds"] += time.perf_counter() - started
        runs[name]["outputs"].append(result.token_ids)
        runs[name]["drafted"] += result.stats.get("drafted", 0)
        runs[name]["accepted"] += result.stats.get("accepted", 0)
for name, run in runs.items():
    run["acceptance"] = round(run["accepted"] / run["drafted"], 3) if run["drafted"] else None
    run["same_as_plain"] = sum(a == b for a, b in zip(run["outputs"], runs["plain"]["outputs"], strict=True))
    run["seconds"] = round(run["seconds"], 1)
    print(f"{name:20s} acceptance {run['acceptance']}  same as plain {run['same_as_plain']}/{len(prompts)}")
report = {"config": {"prompts": len(prompts), "max_tokens": max_tokens, "k": 4, "dtype": "bfloat16",
                     "activation_levels_here": w8a8_linear.activation_levels(), "torch": torch.__version__},
          "runs": runs}
with open(out, "w") as handle:
    json.dump(report, handle, indent=1)
