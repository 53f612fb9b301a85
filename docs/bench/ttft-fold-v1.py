"""TTFT A/B: a prompt fed in the forward that scores it (new) against prefill then a separate scoring forward (old),
one process, real target bf16, the 8 shipped prompts chat-templated; alternated per repeat."""
import json
import statistics
import sys
import time

import torch

torch.set_num_threads(2)
from tandem.bench.prompts import load_prompts  # noqa: E402
from tandem.core.config import EngineConfig, SamplingParams  # noqa: E402
from tandem.core.runner import ModelRunner  # noqa: E402
from tandem.engines.local import build_engine, encode_prompt  # noqa: E402
from tandem.models.loader import load_model  # noqa: E402

target = load_model("qwen2.5-coder-1.5b-instruct", device=torch.device("cpu"), dtype=torch.bfloat16, progress=False)
ids = [encode_prompt(target.tokenizer, t, chat=True) for t in load_prompts()[:8]]
eng = build_engine(target, None, EngineConfig(calibrate=False), kv_tokens=16384)
fits = ModelRunner.__dict__["fits_one_forward"]
one = SamplingParams(temperature=0.0, max_tokens=1)
def ttft(prompts):
    t = time.perf_counter()
    out = eng.generate(prompts, one)
    return time.perf_counter() - t, [r.token_ids for r in out]
eng.generate(ids, SamplingParams(temperature=0.0, max_tokens=2))
res = {"old": {"b1": [], "b8": []}, "new": {"b1": [], "b8": []}}
tokens = {}
for rep in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    for mode in (("new", "old") if rep % 2 == 0 else ("old", "new")):
        ModelRunner.fits_one_forward = fits if mode == "new" else staticmethod(lambda states: False)
        for _i, p in enumerate(ids):
            s, out = ttft([p])
            res[mode]["b1"].append(s)
            tokens.setdefault((mode, "b1"), []).append(out[0])
        s, out = ttft(ids)
        res[mode]["b8"].append(s)
        tokens[(mode, "b8")] = out
        print(mode, rep, "b1 mean %.3f s" % statistics.mean(res[mode]["b1"][-8:]),  # noqa: UP031
              "b8 %.2f s" % s, flush=True)  # noqa: UP031
summary = {m: {k: statistics.median(v) for k, v in d.items()} for m, d in res.items()}
report = {"what": __doc__, "machine": "CPU-A (2 vCPU AMD EPYC, AVX512-BF16)", "torch_threads": 2,
          "prompt_lengths": [len(p) for p in ids], "seconds": res, "median_seconds": summary,
          "new_over_old_speedup": {k: summary["old"][k] / summary["new"][k] for k in ("b1", "b8")},
          "first_tokens_equal": tokens[("new", "b8")] == tokens[("old", "b8")]}
print(json.dumps({k: report[k] for k in ("median_seconds", "new_over_old_speedup", "first_tokens_equal")}))
with open(sys.argv[2] if len(sys.argv) > 2 else "/tmp/prof/ttft-ab.json", "w") as fh:
    json.dump(report, fh, indent=1)
