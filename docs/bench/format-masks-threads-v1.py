"""Where a CPU worker computes a step's masks: on llguidance's thread pool (LLExecutor) or one row after another on
the worker's own thread, against no format at all. The real target, plain decoding, batch 1, structured-v1.py's first
4 prompts under its JSON schema, 96 tokens, greedy; per prompt the three in one order, the next prompt reversed.

    PYTHONPATH=services python docs/bench/format-masks-threads-v1.py float32 format-masks-threads.json   # ~5 min
"""
import json
import sys
import time
from pathlib import Path

import torch

from tandem.core.config import EngineConfig, OutputFormat, SamplingParams
from tandem.engines.local import build_engine, encode_prompt
from tandem.models.loader import load_pair

source = Path(__file__).with_name("structured-v1.py").read_text()
namespace: dict = {}
exec(source[source.index("SCHEMA = "): source.index("TOKENS = ")], namespace)  # SCHEMA, SNIPPETS, PROMPT only
dtype, out = sys.argv[1], sys.argv[2]
torch.set_num_threads(2)
draft, target = load_pair("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", device=torch.device("cpu"),
                          dtype=getattr(torch, dtype), progress=False)
ids = [encode_prompt(target.tokenizer, namespace["PROMPT"].format(code), chat=True)
       for code in namespace["SNIPPETS"][:4]]
engine = build_engine(target, None, EngineConfig(calibrate=False), kv_tokens=4096)
masks = engine.verifier.formats
fmt = OutputFormat("json_schema", json.dumps(namespace["SCHEMA"]))
engine.generate(ids[:1], SamplingParams(temperature=0.0, max_tokens=4, output_format=fmt))  # warm
modes = ["threads", "own-thread", "free"]
totals = {mode: {"tokens": 0, "seconds": 0.0} for mode in modes}
for index, prompt in enumerate(ids):
    for mode in modes if index % 2 == 0 else modes[::-1]:
        masks.parallel = mode == "threads"
        params = SamplingParams(temperature=0.0, max_tokens=96, output_format=None if mode == "free" else fmt)
        started = time.perf_counter()
        result = engine.generate([prompt], params)[0]
        totals[mode]["seconds"] += time.perf_counter() - started
        totals[mode]["tokens"] += len(result.token_ids)
    print(index, {mode: round(row["tokens"] / row["seconds"], 3) for mode, row in totals.items()}, flush=True)
for row in totals.values():
    row["tok_s"] = round(row["tokens"] / row["seconds"], 3)
report = {"dtype": dtype, "prompts": len(ids), "max_tokens": 96, "batch": 1, "runs": totals,
          "over_free": {mode: round(totals[mode]["tok_s"] / totals["free"]["tok_s"], 3) for mode in modes[:2]}}
print(json.dumps(report["over_free"]))
with open(out, "w") as sink:
    json.dump(report, sink, indent=1)
