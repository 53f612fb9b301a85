"""The w4 draft at two int4 group sizes (128 inputs per scale and zero point, and 64) against the w8a8 draft, one
sitting. First the one-row int4 products alone at each group size (the 0.5B draft's 96 layer products, 24 layers of
distinct random weights of the real shapes so they stream from memory, bf16, the groups' order alternating per round,
the median of rounds 3 on). Then plain decoding and AUTO with each draft (tandem.bench.draft_weights.compare_engines:
greedy, batch 1, the chat-templated shipped prompts one by one, the engines in a rotating order per prompt), every
runner compiled, drafts scoring the first 65536 ids, as the vLLM comparison runs tandem. Each w4 draft is loaded with
core.w4_linear.GROUPS set to the group size under test; the w8a8 draft has no int4 copy.

    PYTHONPATH=services python docs/bench/w4-groups-v1.py out.json      # 10-30 min, a cold compile per w4 draft
"""
import statistics
import sys
import time

import torch

from tandem.bench.draft_weights import compare_engines, print_runs
from tandem.bench.prompts import load_prompts
from tandem.cli.options import write_json
from tandem.core import w4_linear
from tandem.core.packed_linear import weight_bytes
from tandem.engines.local import encode_prompt
from tandem.models.loader import load_model

torch.set_num_threads(2)
OUT = sys.argv[1] if len(sys.argv) > 1 else None
cpu, dtype = torch.device("cpu"), torch.bfloat16
shipped = w4_linear.GROUPS
GROUP_SIZES = (128, 64)


def one_row_products_ms() -> dict[int, float]:
    torch.manual_seed(0)
    shapes = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]  # [out, in]: fused q/k/v, o, fused gate/up, down
    layers: dict[int, list] = {group: [] for group in GROUP_SIZES}
    for _ in range(24):
        for out_features, in_features in shapes:
            weight = (torch.randn(out_features, in_features) * 0.02).to(dtype)
            for group in GROUP_SIZES:
                w4_linear.GROUPS = (group, 32)
                layers[group].append(w4_linear.W4Linear(weight, None, dtype))
    rounds: dict[int, list[float]] = {group: [] for group in GROUP_SIZES}
    for round_index in range(14):
        for group in GROUP_SIZES[:: 1 if round_index % 2 == 0 else -1]:
            rows = {width: torch.randn(1, width, dtype=dtype) for width in (896, 4864)}
            started = time.perf_counter()
            for layer in layers[group]:
                layer(rows[layer.in_features])
            rounds[group].append(time.perf_counter() - started)
    return {group: round(statistics.median(times[3:]) * 1e3, 2) for group, times in rounds.items()}


with torch.inference_mode():
    products_ms = one_row_products_ms()
print("one-row int4 products, ms by group:", products_ms, flush=True)
target = load_model("qwen2.5-coder-1.5b-instruct", device=cpu, dtype=dtype, progress=False, compile=True)
drafts = {"auto_w8a8": load_model("qwen2.5-coder-0.5b-instruct", device=cpu, dtype=dtype, progress=False,
                                  quantization="w8a8", compile=True)}
for group in GROUP_SIZES:
    w4_linear.GROUPS = (group, 32)
    drafts[f"auto_w4_group{group}"] = load_model("qwen2.5-coder-0.5b-instruct", device=cpu, dtype=dtype,
                                                 progress=False, quantization="w4", compile=True)
w4_linear.GROUPS = shipped
prompts = [encode_prompt(target.tokenizer, text, chat=True) for text in load_prompts()]
report = {"config": {"threads": 2, "dtype": "bfloat16", "max_tokens": 128, "compile": True, "draft_vocab": 65536,
                     "torch": torch.__version__,
                     "weight_bytes": {name: weight_bytes(draft.model) for name, draft in drafts.items()}},
          "one_row_int4_products_ms_by_group": products_ms}
report |= compare_engines(target, drafts, prompts, 128, 65536)
print_runs(report)
write_json(OUT, report)
