"""vLLM's half of tandem.bench.vllm_compare: one engine (plain, or draft-model speculation) loaded once, answering
one run at a time.

Runs by path under vLLM's own Python, where tandem is not installed (so it imports nothing of tandem), started by
tandem.bench.vllm_compare (tandem.bench.resident's protocol) with the job as JSON:

    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4 /work/vllm-venv/bin/python \
        services/tandem/bench/vllm_compare_vllm.py job.json RESULT_FD

job: target_dir, draft_dir, spec (bool: draft-model speculation) or method ("draft_model", "ngram": vLLM's n-gram
prompt lookup, 2-4 tokens, or "" for none), k, jobs (chat-templated token ids, one list per prompt), max_tokens,
max_model_len, eos_ids. Each request names a mode and the prompts (indices into jobs) to send in one generate call,
and may give its own max_tokens; its result: tokens, seconds, tok_s, outputs (token ids, EOS stripped as tandem
strips it), acceptance counters.
Loading, compilation and the warm-up requests are left out of the timings.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

# Run by path, this file's folder comes first on sys.path, and its modules' names (core, prompts, serving, ...) must
# not shadow what vLLM imports. Checked, not blindly popped: vLLM's spawned processes run this module again.
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    del sys.path[0]


def _strip_eos(token_ids: list[int], eos: set[int]) -> list[int]:
    """vLLM keeps the EOS that ended a request in its token ids; tandem does not count it. Drop it here alike."""
    return token_ids[:-1] if token_ids and token_ids[-1] in eos else token_ids


def _counters(llm: Any) -> dict[str, float]:
    """vLLM's speculative-decoding counters (drafts, accepted), where this version exposes them."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # metrics are a side note: never fail the run over them
        return {}
    wanted = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
              "vllm:spec_decode_num_accepted_tokens")
    return {m.name.split(":")[1]: float(getattr(m, "value", 0.0)) for m in metrics if m.name in wanted}


def load(job: dict) -> tuple[dict, Any]:
    """One engine (plain, or draft-model speculation with k job["k"]) loaded and warmed up (untimed); what was
    loaded, and the function that answers one request: {"mode": ..., "prompts": indices into job["jobs"]} in one
    generate call, greedy, job["max_tokens"] each."""
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    method = job.get("method", "draft_model" if job.get("spec") else "")
    spec = {"draft_model": {"model": job["draft_dir"], "method": "draft_model", "num_speculative_tokens": job["k"]},
            "ngram": {"method": "ngram", "num_speculative_tokens": job["k"], "prompt_lookup_max": 4,
                      "prompt_lookup_min": 2}}.get(method)
    started = time.perf_counter()
    llm = LLM(model=job["target_dir"], dtype=job["dtype"], max_model_len=job["max_model_len"], seed=0,
              enable_prefix_caching=False, speculative_config=spec, disable_log_stats=spec is None)
    load_seconds = time.perf_counter() - started
    eos = set(job["eos_ids"])
    greedy = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
    warm = SamplingParams(temperature=0.0, max_tokens=min(16, job["max_tokens"]))
    # Warm-up, untimed: the first request of a fresh engine runs several times slower than the next.
    for _ in range(2):
        llm.generate([{"prompt_token_ids": job["jobs"][0]}], warm, use_tqdm=False)
    llm.generate([{"prompt_token_ids": ids} for ids in job["jobs"]], warm, use_tqdm=False)

    def answer(request: dict) -> dict:
        prompts = [job["jobs"][i] for i in request["prompts"]]
        params = greedy if "max_tokens" not in request else SamplingParams(temperature=0.0,
                                                                            max_tokens=request["max_tokens"])
        counters = _counters(llm)
        started = time.perf_counter()
        results = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - started
        outputs = [_strip_eos(list(r.outputs[0].token_ids), eos) for r in results]
        tokens = sum(len(out) for out in outputs)
        result = {"tokens": tokens, "seconds": round(seconds, 4), "tok_s": round(tokens / seconds, 3),
                  "requests": len(prompts), "loadavg_1m": round(os.getloadavg()[0], 2), "outputs": outputs}
        after = _counters(llm)
        if after:
            result["spec_counters"] = {key: after[key] - counters.get(key, 0.0) for key in after}
        print(f"vllm {request['mode']} {request['prompts'][0] if len(prompts) == 1 else 'all'}: {tokens} tokens in "
              f"{seconds:.2f} s = {tokens / seconds:.2f} tok/s", file=sys.stderr, flush=True)
        return result

    loaded = {"load_seconds": round(load_seconds, 1), "speculative_config": spec,
              "versions": {"vllm": vllm.__version__, "torch": torch.__version__}}
    return loaded, answer


def main() -> None:
    """tandem.bench.resident's worker side, its file loaded by path: tandem is not installed under vLLM's Python."""
    spec = importlib.util.spec_from_file_location("tandem_bench_resident", Path(__file__).with_name("resident.py"))
    resident = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(resident)
    resident.serve(load)


if __name__ == "__main__":  # vLLM starts its engine core by spawn, which re-imports this module
    main()
