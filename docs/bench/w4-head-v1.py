"""The w4 draft with its output head kept at w8a8 against the shipped w4 draft (int4 head too), one sitting: plain
decoding and AUTO with each draft (tandem.bench.draft_weights.compare_engines: greedy, batch 1, the chat-templated
shipped prompts one by one, the engines in a rotating order per prompt), every runner compiled, drafts scoring the
first 65536 ids, as the vLLM comparison runs tandem. The head is the one layer whose rounding picks the draft's token
directly; the w8a8 head reads about twice its int4 bytes in every one-row step.

    PYTHONPATH=services python docs/bench/w4-head-v1.py out.json      # 7 min with the compile cache kept
"""
import sys

import torch

from tandem.bench.draft_weights import compare_engines, print_runs
from tandem.bench.prompts import load_prompts
from tandem.cli.options import write_json
from tandem.core.packed_linear import weight_bytes
from tandem.core.w4_linear import W4Linear
from tandem.engines.local import encode_prompt
from tandem.models.loader import load_model

torch.set_num_threads(2)
OUT = sys.argv[1] if len(sys.argv) > 1 else None
cpu, dtype = torch.device("cpu"), torch.bfloat16
target = load_model("qwen2.5-coder-1.5b-instruct", device=cpu, dtype=dtype, progress=False, compile=True)
drafts = {name: load_model("qwen2.5-coder-0.5b-instruct", device=cpu, dtype=dtype, progress=False,
                           quantization="w4", compile=True) for name in ("auto_w4", "auto_w4_head_w8a8")}
head = drafts["auto_w4_head_w8a8"].model.get_output_embeddings()
assert isinstance(head, W4Linear)
drafts["auto_w4_head_w8a8"].model.set_output_embeddings(head.wide)
prompts = [encode_prompt(target.tokenizer, text, chat=True) for text in load_prompts()]
report = {"config": {"threads": 2, "dtype": "bfloat16", "max_tokens": 128, "compile": True, "draft_vocab": 65536,
                     "torch": torch.__version__,
                     "weight_bytes": {name: weight_bytes(draft.model) for name, draft in drafts.items()}}}
report |= compare_engines(target, drafts, prompts, 128, 65536)
print_runs(report)
write_json(OUT, report)
