"""vLLM's half of tandem.bench.vllm_compare: one engine (plain, or draft-model speculation), batch 1 and all at once.

Runs by path under vLLM's own Python, where tandem is not installed (so it imports nothing of tandem), started by
tandem.bench.vllm_compare with the job as JSON:

    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4 /work/vllm-venv/bin/python \
        services/tandem/bench/vllm_compare_vllm.py job.json result.json

job: target_dir, draft_dir, spec (bool), k, prompt_ids (chat-templated token ids, one list per prompt), jobs (the
token ids sent at once), max_tokens, max_model_len, eos_ids, order (["b1", "bN"] or reversed). result: per mode
tokens, seconds, tok_s, outputs (token ids, EOS stripped as tandem strips it), plus versions and acceptance counters.
Loading, compilation and the warm-up requests are left out of the timings.
"""

from __future__ import annotations

import json
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


def _timed(llm: Any, prompts: list[list[int]], params: Any, together: bool, eos: set[int]) -> dict:
    """Generate `prompts` one request after another (together False) or in one generate call; tok/s over the wall."""
    batches = [prompts] if together else [[ids] for ids in prompts]
    outputs: list[list[int]] = []
    started = time.perf_counter()
    for batch in batches:
        results = llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
        outputs += [list(r.outputs[0].token_ids) for r in results]
    seconds = time.perf_counter() - started
    outputs = [_strip_eos(out, eos) for out in outputs]
    tokens = sum(len(out) for out in outputs)
    return {"tokens": tokens, "seconds": round(seconds, 4), "tok_s": round(tokens / seconds, 3),
            "requests": len(prompts), "loadavg_1m": round(os.getloadavg()[0], 2), "outputs": outputs}


def run(job: dict) -> dict:
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    spec = ({"model": job["draft_dir"], "method": "draft_model", "num_speculative_tokens": job["k"]}
            if job["spec"] else None)
    started = time.perf_counter()
    llm = LLM(model=job["target_dir"], dtype=job["dtype"], max_model_len=job["max_model_len"], seed=0,
              enable_prefix_caching=False, speculative_config=spec, disable_log_stats=not job["spec"])
    load_seconds = time.perf_counter() - started
    eos = set(job["eos_ids"])
    greedy = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
    warm = SamplingParams(temperature=0.0, max_tokens=min(16, job["max_tokens"]))
    # Warm-up, untimed: the first request of a fresh engine runs several times slower than the next.
    for _ in range(2):
        llm.generate([{"prompt_token_ids": job["prompt_ids"][0]}], warm, use_tqdm=False)
    llm.generate([{"prompt_token_ids": ids} for ids in job["jobs"]], warm, use_tqdm=False)
    name = "spec" if job["spec"] else "plain"
    modes: dict[str, dict] = {}
    for step in job["order"]:
        together = step != "b1"
        prompts = job["jobs"] if together else job["prompt_ids"]
        counters = _counters(llm)
        result = _timed(llm, prompts, greedy, together, eos)
        after = _counters(llm)
        if after:
            result["spec_counters"] = {key: after[key] - counters.get(key, 0.0) for key in after}
        modes[f"{name}_{step}"] = result
        print(f"vllm {name}_{step}: {result['tokens']} tokens in {result['seconds']:.2f} s = "
              f"{result['tok_s']:.2f} tok/s", file=sys.stderr, flush=True)
    return {"modes": modes, "load_seconds": round(load_seconds, 1),
            "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
            "speculative_config": spec}


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(run(job)))


if __name__ == "__main__":  # vLLM starts its engine core by spawn, which re-imports this module
    main()
