"""Where tandem's plain 8-at-once time goes: the plain engine over the compiled bf16 target, the 8 shipped prompts
at once, 128 tokens, greedy (vllm_compare's plain_b8 run), two untimed warm runs, then one under torch's profiler;
prints the wall time and the profiler's table by self CPU time.

    PYTHONPATH=services python docs/bench/engine-profile-v1.py     # 5 min with inductor's cache kept
"""
import time

import torch
from torch.profiler import ProfilerActivity, profile

from tandem.bench.prompts import load_prompts
from tandem.core.config import EngineConfig, SamplingParams
from tandem.engines.local import build_engine, encode_prompt
from tandem.models.loader import load_model

torch.set_num_threads(2)
target = load_model("qwen2.5-coder-1.5b-instruct", device=torch.device("cpu"), dtype=torch.bfloat16, progress=False,
                    compile=True)
ids = [encode_prompt(target.tokenizer, text, chat=True) for text in load_prompts()][:8]
print("prompt tokens", [len(i) for i in ids], flush=True)
engine = build_engine(target, None, EngineConfig(calibrate=False), kv_tokens=8 * 1024)
greedy = SamplingParams(temperature=0.0, max_tokens=128)
engine.generate([ids[0][:8]], greedy)
engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=4))
for run in range(2):
    started = time.perf_counter()
    tokens = sum(len(r.token_ids) for r in engine.generate(ids, greedy))
    seconds = time.perf_counter() - started
    print(f"run {run}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.2f} tok/s", flush=True)
with profile(activities=[ProfilerActivity.CPU]) as profiler:
    started = time.perf_counter()
    tokens = sum(len(r.token_ids) for r in engine.generate(ids, greedy))
    seconds = time.perf_counter() - started
print(f"profiled: {tokens} tokens in {seconds:.2f} s", flush=True)
print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
