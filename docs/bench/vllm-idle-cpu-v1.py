"""How much CPU vLLM for CPU's engine processes burn while idle between requests, plain and speculative engines.

tandem.bench.vllm_compare runs tandem beside one idle vLLM engine per phase; in v32 tandem ran ~10% faster beside
the speculative engine than beside the plain one. This measures each engine's CPU seconds per wall second in the
1.5 s after a request (vLLM's busy-poll, which the comparison waits out) and in the 20 s after that (idle).

    export VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2 \
        LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:/work/vllm-venv/lib/libiomp5.so
    for s in 0 1; do SPEC=$s /work/vllm-venv/bin/python docs/bench/vllm-idle-cpu-v1.py TARGET DRAFT out.jsonl; done

TARGET and DRAFT: the pulled models' Hugging Face directories (~/.cache/tandem/models/<name>/hf). SPEC=1
loads the speculative engine (k 4), as the comparison's speculative phase does; each line of out.jsonl is one engine.
"""

import json
import os
import sys
import time

import psutil


def tree_cpu() -> float:
    me = psutil.Process(os.getpid())
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.NoSuchProcess:
            pass
    return total


def window(seconds: float) -> float:
    c0, w0 = tree_cpu(), time.perf_counter()
    time.sleep(seconds)
    return round((tree_cpu() - c0) / (time.perf_counter() - w0), 3)


def main() -> None:
    from vllm import LLM, SamplingParams

    target, draft, out = sys.argv[1:4]
    spec = os.environ.get("SPEC") == "1"
    speculative = {"model": draft, "method": "draft_model", "num_speculative_tokens": 4} if spec else None
    llm = LLM(model=target, dtype="bfloat16", max_model_len=2048, seed=0, enable_prefix_caching=False,
              speculative_config=speculative, disable_log_stats=not spec)
    params = SamplingParams(temperature=0.0, max_tokens=32)
    rows = []
    for _ in range(3):
        llm.generate(["def fibonacci(n):"], params, use_tqdm=False)
        rows.append({"busy_poll_1.5s": window(1.5), "idle_20s": window(20.0)})
    result = {"engine": "spec" if spec else "plain", "cpu_seconds_per_second": rows}
    print(json.dumps(result))
    with open(out, "a") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
