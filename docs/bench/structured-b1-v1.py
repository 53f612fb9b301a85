"""Structured outputs at batch 1 on the real pair: structured-v1.py's 8 prompts one at a time, greedy, 160 tokens,
plain decoding and AUTO, each with the JSON schema and without; per prompt the four runs in one order, the next prompt
in the reverse order. Reports pooled tok/s per configuration and AUTO over plain with and without the schema.

    PYTHONPATH=services python docs/bench/structured-b1-v1.py float32 structured-b1.json   # ~15 min on 2 cores
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
SCHEMA, SNIPPETS, PROMPT = namespace["SCHEMA"], namespace["SNIPPETS"], namespace["PROMPT"]
TOKENS = 160

dtype, out = sys.argv[1], sys.argv[2]
torch.set_num_threads(2)
draft, target = load_pair("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", device=torch.device("cpu"),
                          dtype=getattr(torch, dtype), progress=False)
ids = [encode_prompt(target.tokenizer, PROMPT.format(code), chat=True) for code in SNIPPETS]
engines = {"plain": build_engine(target, None, EngineConfig(calibrate=False), kv_tokens=4096),
           "auto": build_engine(target, draft, EngineConfig(), kv_tokens=4096)}
fmt = OutputFormat("json_schema", json.dumps(SCHEMA))
engines["plain"].generate(ids[:1], SamplingParams(temperature=0.0, max_tokens=4, output_format=fmt))  # warm
configs = [("plain", True), ("auto", True), ("auto", False), ("plain", False)]
totals = {f"{m}-{'schema' if f else 'free'}": {"tokens": 0, "seconds": 0.0, "drafted": 0, "accepted": 0}
          for m, f in configs}
for index, prompt in enumerate(ids):
    for mode, formatted in configs if index % 2 == 0 else configs[::-1]:
        params = SamplingParams(temperature=0.0, max_tokens=TOKENS, output_format=fmt if formatted else None)
        started = time.perf_counter()
        result = engines[mode].generate([prompt], params)[0]
        row = totals[f"{mode}-{'schema' if formatted else 'free'}"]
        row["seconds"] += time.perf_counter() - started
        row["tokens"] += len(result.token_ids)
        row["drafted"] += result.stats["drafted"]
        row["accepted"] += result.stats["accepted"]
    print(index, {name: round(row["tokens"] / row["seconds"], 3) for name, row in totals.items()}, flush=True)
for row in totals.values():
    row["tok_s"] = round(row["tokens"] / row["seconds"], 3)
    row["acceptance"] = round(row["accepted"] / row["drafted"], 4) if row["drafted"] else None
report = {"dtype": dtype, "prompts": len(ids), "max_tokens": TOKENS, "batch": 1, "runs": totals,
          "auto_over_plain": {kind: round(totals[f"auto-{kind}"]["tok_s"] / totals[f"plain-{kind}"]["tok_s"], 3)
                              for kind in ("schema", "free")}}
print(json.dumps(report["auto_over_plain"]))
with open(out, "w") as sink:
    json.dump(report, sink, indent=1)
