"""core.cpu_attention's decode-attention kernel against PyTorch's sdpa, end to end in one process: the engines of
the vLLM comparison (tandem.bench.vllm_compare_tandem.build_engines: the pair compiled, w4 draft, the draft's head
cut to 65536 ids, calibrated and warmed up with the kernel), the 8 shipped prompts at once and the first prompt
alone, 128 tokens each (past the end-of-sequence token: bf16 attention rounds differently, and an arm whose rows
stopped sooner would run a smaller batch for the rest of the run), greedy. Modes, the kernel on and off
(core.cpu_attention.ENABLED, which compiled forwards guard on: each arm runs its own compiled graphs, warmed up by one
untimed run of every mode first):
  plain_b8   the plain engine, the 8 prompts at once
  auto_b8    the AUTO engine, the 8 prompts at once; each arm keeps its own cost model (calibration's, then its own
             observations carried from run to run), so neither prices rounds with the other's timings
  plain_b1   the plain engine, the first prompt alone
Each repeat runs every mode's two arms back to back, the arm first in the pair alternated between repeats. Per mode:
tok/s pooled over its runs per arm, the ratio kernel/sdpa, and in how many runs both arms' tokens agreed (bf16: a
different rounding of attention may part greedy outputs at near-ties).

    PYTHONPATH=services python docs/bench/cpu-attention-ab-v1.py REPEATS OUT.json [MODES]   # about 4 min a repeat

MODES, comma-separated, picks some of the modes above (all of them by default).
"""

from __future__ import annotations

import copy
import json
import sys
import time

import torch

from tandem.bench.prompts import load_prompts
from tandem.bench.vllm_compare_tandem import build_engines, sitting_job
from tandem.core import cpu_attention
from tandem.core.config import SamplingParams
from tandem.core.costs import MEASURED_FIELDS

MODES = {"plain_b8": ("plain", 8), "auto_b8": ("auto", 8), "plain_b1": ("plain", 1)}
ARMS = {"kernel": True, "sdpa": False}


def run(engine, ids: list[list[int]], max_tokens: int) -> dict:
    started = time.perf_counter()
    results = engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    seconds = time.perf_counter() - started
    tokens = sum(len(r.token_ids) for r in results)
    return {"seconds": round(seconds, 3), "tokens": tokens, "tok_s": round(tokens / seconds, 3),
            "drafted": sum(r.stats["drafted"] for r in results), "ids": [list(r.token_ids) for r in results]}


def main(repeats: int, out: str, modes: dict[str, tuple[str, int]]) -> None:
    job = sitting_job(load_prompts(None)[:8])
    loaded, engines, ids = build_engines(job)
    assert cpu_attention.ready(), "the kernel does not run on this machine"
    costs = engines["auto"].costs
    kept = {arm: {name: copy.deepcopy(getattr(costs, name)) for name in MEASURED_FIELDS} for arm in ARMS}

    def timed(mode: str, arm: str) -> dict:
        engine_name, rows = MODES[mode]
        cpu_attention.ENABLED[0] = ARMS[arm]
        if engine_name == "auto":
            for name in MEASURED_FIELDS:
                setattr(costs, name, kept[arm][name])
        try:
            return run(engines[engine_name], ids[:rows], job["max_tokens"])
        finally:
            cpu_attention.ENABLED[0] = True

    for mode in modes:  # compile each arm's graphs for every shape its runs meet
        for arm in ARMS:
            timed(mode, arm)
    runs: dict[str, dict[str, list[dict]]] = {mode: {arm: [] for arm in ARMS} for mode in modes}
    for repeat in range(repeats):
        for mode in modes:
            for arm in list(ARMS)[:: 1 if repeat % 2 == 0 else -1]:
                result = timed(mode, arm)
                runs[mode][arm].append(result)
                print(mode, arm, json.dumps({k: v for k, v in result.items() if k != "ids"}), flush=True)
    summary = {}
    for mode, arms in runs.items():
        pooled = {arm: sum(r["tokens"] for r in items) / sum(r["seconds"] for r in items)
                  for arm, items in arms.items()}
        summary[mode] = {**{f"{arm}_tok_s": round(tok_s, 3) for arm, tok_s in pooled.items()},
                         "kernel_over_sdpa": round(pooled["kernel"] / pooled["sdpa"], 4),
                         "kernel_over_sdpa_each": [round(a["tok_s"] / b["tok_s"], 4)
                                                   for a, b in zip(arms["kernel"], arms["sdpa"], strict=True)],
                         "same_tokens": sum(a["ids"] == b["ids"] for a, b in zip(arms["kernel"], arms["sdpa"],
                                                                                 strict=True)),
                         "runs": len(arms["kernel"])}
    report = {"config": {**{k: v for k, v in job.items() if k != "texts"}, "repeats": repeats, "modes": list(modes),
                         "torch": torch.__version__, "loaded": loaded},
              "summary": summary,
              "runs": {mode: {arm: [{k: v for k, v in r.items() if k != "ids"} for r in items]
                              for arm, items in arms.items()} for mode, arms in runs.items()}}
    with open(out, "w") as sink:
        json.dump(report, sink, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    chosen = sys.argv[3].split(",") if len(sys.argv) > 3 else list(MODES)
    main(int(sys.argv[1]), sys.argv[2], {mode: MODES[mode] for mode in chosen})
