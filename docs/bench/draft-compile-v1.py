"""The w8a8 draft's decode forward (one row, one token, ~100 cached tokens) compiled (ModelRunner(compile=True), as
`--compile` runs it) against eager, one process, bf16 activations, 2 threads, 30 alternated pairs after the compile
and a warm-up. A lead for compiling the draft alone: the draft's forwards are over half of AUTO's time at batch 1.
Run: PYTHONPATH=services python docs/bench/draft-compile-v1.py OUT.json"""
import json
import statistics
import sys
import time

import torch

torch.set_num_threads(2)
from tandem.core.runner import ModelRunner  # noqa: E402
from tandem.models.loader import load_pair  # noqa: E402

draft, target = load_pair("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", device=torch.device("cpu"),
                          dtype=torch.bfloat16, progress=False, draft_quantization="w8a8")
del target
eager = ModelRunner(draft.model, kv_tokens=8192)
comp = ModelRunner(draft.model, kv_tokens=8192, compile=True)
def setup(r):
    st = r.state("s0")
    st.sync(0, [(7 + 13 * j) % r.vocab_size for j in range(100)])
    r.prefill_many([st], [len(st.tokens)])
    return st
se, sc = setup(eager), setup(comp)
def fwd(r, st):
    keep = st.cached
    st.sync(st.cached, [5])
    t = time.perf_counter()
    out = r.forward_on_device([st], [1])
    s = time.perf_counter() - t
    st.sync(keep, [])
    return s, out
t = time.perf_counter()
fwd(comp, sc)
first = time.perf_counter() - t
for _ in range(3):
    fwd(comp, sc)
    fwd(eager, se)
a, b = [], []
for i in range(30):
    for name in (("e", "c") if i % 2 == 0 else ("c", "e")):
        if name == "e":
            a.append(fwd(eager, se)[0])
        else:
            b.append(fwd(comp, sc)[0])
report = {"what": __doc__, "machine": "CPU-A (2 vCPU AMD EPYC, AVX512-BF16, no AMX)",
          "first_compiled_call_s": round(first, 1),
          "eager_ms": [round(1e3 * s, 2) for s in a], "compiled_ms": [round(1e3 * s, 2) for s in b],
          "eager_over_compiled": round(statistics.median(a) / statistics.median(b), 3)}
print(report["eager_over_compiled"], 1e3 * statistics.median(a), 1e3 * statistics.median(b))
oe, oc = fwd(eager, se)[1].float(), fwd(comp, sc)[1].float()
report |= {"max_logit_difference": (oe - oc).abs().max().item(),
           "same_argmax": torch.equal(oe.argmax(-1), oc.argmax(-1))}
with open(sys.argv[1], "w") as fh:
    json.dump(report, fh, indent=1)
print(report["max_logit_difference"], report["same_argmax"])
