"""How often the draft's greedy choice is the target's, for the draft as loaded (bf16), w8a8 and w4: the target's
greedy continuation of each shipped prompt (chat template, `tokens` new tokens, Hugging Face generate on the loaded
target), then each draft fed that sequence one token at a time after its prompt, as drafting feeds it (so a w4 draft
takes its int4 products), its top choice compared with the target's next token, over the whole vocabulary and over
the first 65536 ids (`--draft-vocab 65536`). A proxy for greedy acceptance, not the engine's.

    PYTHONPATH=services python docs/bench/w4-agreement-v1.py 64 out.json     # 4 min
"""
import json
import sys
import time

import torch
from transformers import DynamicCache

from tandem.bench.prompts import load_prompts
from tandem.models.loader import load_model

torch.set_num_threads(2)
N = int(sys.argv[1]) if len(sys.argv) > 1 else 64
OUT = sys.argv[2] if len(sys.argv) > 2 else None
dev, dt = torch.device("cpu"), torch.bfloat16
with torch.inference_mode():
    tgt = load_model("qwen2.5-coder-1.5b-instruct", device=dev, dtype=dt, progress=False)
    tok = tgt.tokenizer
    seqs = []
    t0 = time.time()
    for p in load_prompts():
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt")
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        out = tgt.model.generate(ids, max_new_tokens=N, do_sample=False)
        seqs.append((ids.shape[1], out[0].tolist()))
    print("target done", time.time() - t0, flush=True)
    del tgt
    res = {}
    for q in ("w8a8", "w4", "none"):
        d = load_model("qwen2.5-coder-0.5b-instruct", device=dev, dtype=dt, progress=False, quantization=q).model
        agree = agree64k = total = 0
        step_s = []
        for plen, s in seqs:
            cache = DynamicCache()
            out = d(torch.tensor([s[:plen]]), past_key_values=cache, use_cache=True)
            logits = out.logits[0, -1]
            for i in range(plen, len(s)):
                total += 1
                agree += int(logits.argmax().item() == s[i])
                agree64k += int(logits[:65536].argmax().item() == s[i])
                t = time.perf_counter()
                out = d(torch.tensor([[s[i]]]), past_key_values=cache, use_cache=True)
                step_s.append(time.perf_counter() - t)
                logits = out.logits[0, -1]
        step_s.sort()
        res[q] = {"agree": round(agree / total, 4), "agree_first_65536": round(agree64k / total, 4), "positions": total,
                  "eager_step_ms_median": round(step_s[len(step_s) // 2] * 1e3, 2)}
        print(q, res[q], flush=True)
print(json.dumps(res))
if OUT:
    with open(OUT, "w") as sink:
        json.dump({"tokens": N, "threads": 2, "dtype": "bfloat16", "drafts": res}, sink, indent=1)
