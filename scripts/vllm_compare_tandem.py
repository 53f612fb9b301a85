"""tandem's half of scripts/vllm_compare.py: plain and AUTO at batch 1, and N requests at once, in one process.

Started by scripts/vllm_compare.py with tandem's Python and the job as JSON:

    python scripts/vllm_compare_tandem.py job.json result.json

job: target, draft (registry names or paths), prompts (texts; the chat template is applied as `tandem bench` does),
jobs (the texts sent at once), max_tokens, threads, repeat, order (["b1", "bN"] or reversed). Batch 1 is
tandem.bench.runner.run_bench with methods plain and tandem (AUTO), prompt by prompt interleaved; N at once is one
engine.generate call over all jobs on a plain engine and on an AUTO engine, both bf16 on the CPU. Loading,
calibration and warm-up requests are left out of the timings.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch


def _batched(engine, ids: list[list[int]], max_tokens: int) -> dict:
    from tandem.core.config import SamplingParams

    started = time.perf_counter()
    results = engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    seconds = time.perf_counter() - started
    tokens = sum(len(r.token_ids) for r in results)
    drafted = sum(r.stats["drafted"] for r in results)
    accepted = sum(r.stats["accepted"] for r in results)
    return {"tokens": tokens, "seconds": round(seconds, 4), "tok_s": round(tokens / seconds, 3),
            "requests": len(ids), "loadavg_1m": round(os.getloadavg()[0], 2),
            "alpha": round(accepted / drafted, 4) if drafted else 0.0,
            "outputs": [list(r.token_ids) for r in results]}


def run(job: dict) -> dict:
    import transformers

    from tandem.bench.runner import run_bench
    from tandem.core.config import EngineConfig, SamplingParams
    from tandem.local_engine import build_engine, encode_prompt
    from tandem.models.loader import load_pair

    torch.set_num_threads(job["threads"])
    started = time.perf_counter()
    draft, target = load_pair(job["draft"], job["target"], device=torch.device("cpu"), dtype=torch.bfloat16,
                              progress=False)
    load_seconds = time.perf_counter() - started
    n = len(job["jobs"])
    engines: dict = {}
    ids = [encode_prompt(target.tokenizer, text, chat=True) for text in job["jobs"]]
    modes: dict[str, dict] = {}
    for step in job["order"]:
        if step == "b1":
            report = run_bench(target, draft, job["prompts"], job["max_tokens"], ("plain", "tandem"),
                               EngineConfig(), progress=False)
            modes["plain_b1"] = report["plain"] | {"loadavg_1m": round(os.getloadavg()[0], 2)}
            modes["auto_b1"] = report["tandem"] | {
                key: report[key] for key in ("tandem_vs_plain", "greedy_identical_to_plain", "bound") if key in report}
        else:
            if not engines:  # built once, warmed up with one short batch each
                engines["plain"] = build_engine(target, None, EngineConfig(calibrate=False))
                engines["auto"] = build_engine(target, draft, EngineConfig())
                for engine in engines.values():
                    engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=4))
            for name in ("plain", "auto") if job["repeat"] % 2 == 0 else ("auto", "plain"):
                modes[f"{name}_b{n}"] = _batched(engines[name], ids, job["max_tokens"])
        for name in [m for m in modes if m.endswith(f"_{step}")]:
            print(f"tandem {name}: {modes[name]['tokens']} tokens in {modes[name]['seconds']:.2f} s = "
                  f"{modes[name]['tok_s']:.2f} tok/s", file=sys.stderr, flush=True)
    return {"modes": modes, "load_seconds": round(load_seconds, 1),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
            "torch_threads": torch.get_num_threads()}


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(run(job)))


if __name__ == "__main__":
    main()
