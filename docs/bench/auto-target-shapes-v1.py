"""Which target forwards an 8-at-once run is made of, plain against AUTO, and what each shape took: the engines of
the vLLM comparison (tandem.bench.vllm_compare_tandem.build_engines: the pair compiled, w4 draft, the draft's head
cut to 65536 ids, calibrated and warmed up), the 8 shipped prompts at once, 128 tokens, greedy, in the order plain,
AUTO, AUTO, plain, one engine each carried from run to run. Each target forward keyed by the slots it spans (hi),
its rows, its widest row (w), the tokens it feeds and the logits it keeps; per key its count, median and total
seconds. At the end the AUTO engine's prices for 6-8 rows at widths 1-4 (its cost model's batch_forward_time).

    PYTHONPATH=services python docs/bench/auto-target-shapes-v1.py OUT.json     # about 10 min on CPU-A
"""

import json
import statistics
import sys
import time
from collections import defaultdict

from tandem.bench.prompts import load_prompts
from tandem.bench.vllm_compare_tandem import build_engines, sitting_job
from tandem.core.config import SamplingParams

texts = load_prompts(None)[:8]
job = sitting_job(texts)
loaded, engines, ids = build_engines(job)
out = {}
for mode in ("plain", "auto", "auto", "plain"):
    eng = engines[mode]
    rec = defaultdict(list)
    runner = eng.verifier.runner
    inner = runner.forward_on_device

    def fwd(states, wants, inner=inner, rec=rec):
        widths = [len(s.pending) for s in states]
        hi = max(s.slot for s in states) + 1
        t = time.perf_counter()
        r = inner(states, wants)
        dt = time.perf_counter() - t
        rec[f"hi{hi}_rows{len(states)}_w{max(widths)}_fed{sum(widths)}_want{sum(wants)}"].append(dt)
        return r
    runner.forward_on_device = fwd
    t0 = time.perf_counter()
    res = eng.generate(ids, SamplingParams(temperature=0.0, max_tokens=128))
    sec = time.perf_counter() - t0
    del runner.forward_on_device
    toks = sum(len(r.token_ids) for r in res)
    shapes = {k: {"n": len(v), "median_ms": round(statistics.median(v) * 1e3, 1), "total_s": round(sum(v), 3)}
              for k, v in sorted(rec.items(), key=lambda kv: -sum(kv[1]))}
    print(mode, round(sec, 2), toks, round(toks / sec, 2), flush=True)
    for k, v in list(shapes.items())[:14]:
        print("  ", k, v)
    out.setdefault(mode, []).append({"seconds": sec, "tokens": toks, "shapes": shapes})
c = engines["auto"].costs
out["prices"] = {f"{r}x{w}": round(c.batch_forward_time(r, w) * 1e3, 1) for r in (6, 7, 8) for w in (1, 2, 3, 4)}
print(out["prices"])
with open(sys.argv[1], "w") as sink:
    json.dump(out, sink, indent=1)
