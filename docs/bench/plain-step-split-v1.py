"""Plain batch-1 decode of the compiled target, one process: wall per token against the time inside the engine step,
the verifier, the runner's forward, the static (compiled) forward and the output head, by wrapping each with a timer.
Its JSON was taken at cac4b4c, before core.packed_linear.lower_to_onednn; a run at a later commit compiles
the default variant with that lowering.

    PYTHONPATH=services python docs/bench/plain-step-split-v1.py compile 128     # about 10 min, most of it compiling
"""
import json
import sys
import time

import torch

from tandem.bench.prompts import load_prompts
from tandem.core.config import EngineConfig, SamplingParams
from tandem.engines.local import build_engine, encode_prompt
from tandem.models.loader import load_model

torch.set_num_threads(2)
compile_ = sys.argv[1] == "compile"
tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 128
t0 = time.perf_counter()
target = load_model("qwen2.5-coder-1.5b-instruct", device=torch.device("cpu"), dtype=torch.bfloat16, progress=False,
                    compile=compile_)
engine = build_engine(target, None, EngineConfig(calibrate=False), kv_tokens=8 * 1300)
print(f"loaded+warm in {time.perf_counter()-t0:.0f}s", file=sys.stderr, flush=True)
runner = engine.verifier.runner
spent = {}
def wrap(obj, name, key):
    fn = getattr(obj, name)
    def timed(*a, **k):
        s = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[key] = spent.get(key, 0.0) + time.perf_counter() - s
    setattr(obj, name, timed)
wrap(engine, "step", "step")
wrap(engine.verifier, "verify", "verify")
wrap(runner, "_forward", "runner_forward")
if runner.graphs is not None:
    wrap(runner.graphs, "_body", "static_forward")
wrap(runner, "head", "head")
texts = load_prompts()
ids = [encode_prompt(target.tokenizer, t, chat=True) for t in texts][:4]
engine.generate([ids[0][:8]], SamplingParams(temperature=0.0, max_tokens=16))
out = []
for i, p in enumerate(ids):
    spent.clear()
    s = time.perf_counter()
    r = engine.generate([p], SamplingParams(temperature=0.0, max_tokens=tokens))[0]
    wall = time.perf_counter() - s
    n = len(r.token_ids)
    row = {"prompt": i, "tokens": n, "wall_ms_per_token": 1000 * wall / n,
           **{k + "_ms_per_token": 1000 * v / n for k, v in spent.items()}}
    out.append(row)
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
