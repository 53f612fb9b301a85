"""Plain batch-1 decoding end to end, compiled target, one process: two engines over one model, one compiled without
core.packed_linear.lower_to_onednn (the packed product through the custom op's Python kernel), one with it; each
prompt through both, the order alternating per prompt. Inductor's on-disk graph cache is off (its key does not see a
lowering); only the shape classes these requests use are compiled (no warm-up).

    PYTHONPATH=services python docs/bench/onednn-lowering-e2e-v1.py 8 128 out.json     # about 12 min
"""
import json
import statistics
import sys
import time

import torch
import torch._inductor.config as inductor_config
from torch._inductor.lowering import lowerings

from tandem.bench.prompts import load_prompts
from tandem.core import packed_linear
from tandem.core.config import EngineConfig, SamplingParams
from tandem.core.runner import ModelRunner
from tandem.engines.local import build_engine, encode_prompt
from tandem.models.loader import load_model

torch.set_num_threads(2)
prompts, max_tokens, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
inductor_config.fx_graph_cache = False
ModelRunner.warm_up = lambda self: 0
target = load_model("qwen2.5-coder-1.5b-instruct", device=torch.device("cpu"), dtype=torch.bfloat16, progress=False,
                    compile=True)
ids = [encode_prompt(target.tokenizer, text, chat=True) for text in load_prompts()][:prompts]
greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
engines, kernel_calls = {}, {}
kernel = packed_linear._product
for variant in ("kernel", "direct"):
    engine = build_engine(target, None, EngineConfig(calibrate=False), kv_tokens=8 * 1300)
    graphs = engine.verifier.runner.graphs
    if variant == "kernel":
        lowerings.pop(torch.ops.tandem.onednn_linear.default, None)
    else:
        packed_linear.lower_to_onednn.__wrapped__()
        graphs.forward = torch.compile(graphs.plain_forward, dynamic=True, fullgraph=True,
                                       options={"max_autotune": False})  # a new backend: compiled anew
    engine.generate([ids[0][:8]], SamplingParams(temperature=0.0, max_tokens=8))  # compiles
    count = [0]

    def counted(*args, count=count):
        count[0] += 1
        return kernel(*args)
    packed_linear._product = counted
    result = engine.generate([ids[0][:8]], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0]
    packed_linear._product = kernel
    kernel_calls[variant] = round(count[0] / len(result.token_ids), 1)  # per token, the head's call included
    engines[variant] = engine
rows = []
for index, prompt in enumerate(ids):
    row = {"prompt": index}
    for variant in (("kernel", "direct") if index % 2 == 0 else ("direct", "kernel")):
        started = time.perf_counter()
        result = engines[variant].generate([prompt], greedy)[0]
        seconds = time.perf_counter() - started
        row[variant] = {"tokens": len(result.token_ids), "tok_s": round(len(result.token_ids) / seconds, 3),
                        "ids": list(result.token_ids)}
    row["direct_over_kernel"] = round(row["direct"]["tok_s"] / row["kernel"]["tok_s"], 4)
    row["identical"] = row["direct"]["ids"] == row["kernel"]["ids"]
    print(json.dumps({k: v for k, v in row.items() if k not in ("kernel", "direct")}), flush=True)
    rows.append(row)
pooled = {v: sum(r[v]["tokens"] for r in rows) / sum(r[v]["tokens"] / r[v]["tok_s"] for r in rows)
          for v in ("kernel", "direct")}
report = {"prompts": prompts, "max_tokens": max_tokens, "threads": 2, "dtype": "bfloat16",
          "python_kernel_calls_per_token": kernel_calls, "tok_s_pooled": {v: round(t, 3) for v, t in pooled.items()},
          "direct_over_kernel_pooled": round(pooled["direct"] / pooled["kernel"], 4),
          "direct_over_kernel_median": round(statistics.median(r["direct_over_kernel"] for r in rows), 4),
          "identical": sum(r["identical"] for r in rows),
          "rows": [{k: ({kk: vv for kk, vv in v.items() if kk != "ids"} if isinstance(v, dict) else v)
                    for k, v in r.items()} for r in rows]}
print(json.dumps({k: v for k, v in report.items() if k != "rows"}), flush=True)
with open(out, "w") as sink:
    json.dump(report, sink, indent=1)
