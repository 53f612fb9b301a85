"""tandem's engines of the vLLM comparison under the OpenMP runtime torch ships (libgomp) against Intel's (libiomp5)
with tcmalloc, both preloaded as tandem.bench.vllm_compare preloads them for vLLM's side: two resident workers of
tandem.bench.vllm_compare_tandem (the sitting's job: the pair compiled, w4 draft, the draft's head cut to 65536 ids,
calibrated and warmed up), loaded one after the other and kept side by side, then asked in turn. Modes: plain_b8
and auto_b8 (the plain or AUTO engine, the 8 shipped prompts at once, 128 tokens, greedy; an EOS ends a row, as in a
sitting). Each repeat runs every mode on both workers back to back, the worker first in the pair alternated between
repeats, with the sitting's 1.5 s pause before each run. Per mode: tok/s pooled per arm, iomp_tcmalloc/gomp, and
each repeat's ratio.

    PYTHONPATH=services .venv/bin/python docs/bench/openmp-engine-ab-v1.py REPEATS OUT.json [IOMP]  # 6 + 2 min a repeat

IOMP defaults to /work/vllm-venv/lib/libiomp5.so (vLLM's venv: intel-openmp
2024.2.1, the version tandem's `cpu` extra pins).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from tandem.bench.prompts import load_prompts
from tandem.bench.resident import Resident
from tandem.bench.vllm_compare import SETTLE_SECONDS, TANDEM_SIDE
from tandem.bench.vllm_compare_tandem import sitting_job
from tandem.core.cpu_runtime import suggested_preload

MODES = ("plain_b8", "auto_b8")


def main(repeats: int, out: str, iomp: str) -> None:
    if not Path(iomp).is_file():
        sys.exit(f"no {iomp}: give IOMP (intel-openmp's libiomp5.so)")
    texts = load_prompts(None)[:8]
    job = sitting_job(texts)
    log = Path(out).with_suffix(".log")
    log.write_text("")
    plain = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    envs = {"gomp": plain, "iomp_tcmalloc": plain | {"LD_PRELOAD": suggested_preload(Path(iomp))}}
    workers = {}
    try:
        for arm, env in envs.items():
            print(f"loading {arm}", flush=True)
            workers[arm] = Resident(arm, TANDEM_SIDE, job, log, env, say=print)
        runs: dict[str, dict[str, list[dict]]] = {mode: {arm: [] for arm in envs} for mode in MODES}
        for repeat in range(repeats):
            for mode in MODES:
                for arm in list(envs)[:: -1 if repeat % 2 else 1]:
                    time.sleep(SETTLE_SECONDS)
                    result = workers[arm].ask({"mode": mode, "prompts": list(range(len(texts)))})
                    result.pop("outputs")
                    runs[mode][arm].append(result)
                    print(repeat, mode, arm, result["tokens"], result["seconds"], result["tok_s"], flush=True)
    finally:
        for worker in workers.values():
            worker.close()
    report: dict = {"repeats": repeats, "iomp": iomp, "job": {k: v for k, v in job.items() if k != "texts"},
                    "loaded": {arm: w.loaded for arm, w in workers.items()}, "modes": {}}
    for mode, arms in runs.items():
        tok_s = {arm: sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs) for arm, rs in arms.items()}
        each = [round(b["tok_s"] / a["tok_s"], 3) for a, b in zip(arms["gomp"], arms["iomp_tcmalloc"], strict=True)]
        report["modes"][mode] = {"tok_s": {arm: round(t, 3) for arm, t in tok_s.items()},
                                 "iomp_tcmalloc_over_gomp": round(tok_s["iomp_tcmalloc"] / tok_s["gomp"], 4),
                                 "ratio_each": each, "runs": arms}
        print(mode, json.dumps({k: v for k, v in report["modes"][mode].items() if k != "runs"}), flush=True)
    with open(out, "w") as sink:
        json.dump(report, sink, indent=1)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "/work/vllm-venv/lib/libiomp5.so")
