"""tandem's engines of the vLLM comparison under several thread-pool and allocator settings: resident workers of
tandem.bench.vllm_compare_tandem (the sitting's job: the pair compiled, w4 draft, the draft's head cut to 65536 ids,
calibrated and warmed up), one per arm, loaded one after the other and kept side by side (each holds about 8.5 GB
while it compiles: two fit in 24 GiB), then asked in turn. Arms (pick any, comma-separated; the first is the base):

    gomp                torch's libgomp and glibc's malloc (no preload)
    gomp_tcmalloc       libgomp, tcmalloc preloaded: the allocator alone
    gomp_active         libgomp with OMP_WAIT_POLICY=ACTIVE: its threads spin between parallel regions instead of
                        sleeping
    iomp_tcmalloc       libiomp5 and tcmalloc preloaded (what vllm_compare and tandem's advice use); libiomp5's
                        threads spin for KMP_BLOCKTIME (200 ms) after a region
    iomp_tcmalloc_bt0   the same with KMP_BLOCKTIME=0: they sleep at once

Each repeat runs every mode on every arm back to back, the arms' order rotated by one between repeats, with the
sitting's 1.5 s pause before each run. Per mode: tok/s pooled per arm, each arm over the first, per repeat.

    PYTHONPATH=services .venv/bin/python docs/bench/openmp-engine-ab-v2.py REPEATS OUT.json ARMS [MODES] [IOMP]

MODES defaults to plain_b8 (also auto_b8, plain_b1); IOMP to .venv/lib/libiomp5.so (tandem's `cpu` extra).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from tandem.bench.prompts import load_prompts
from tandem.bench.resident import Resident
from tandem.bench.vllm_compare import SETTLE_SECONDS
from tandem.bench.vllm_compare_tandem import sitting_job
from tandem.bench.vllm_compare_workers import TANDEM_SIDE
from tandem.core.cpu_runtime import suggested_preload, tcmalloc_path


def arm_envs(names: list[str], iomp: Path) -> dict[str, dict[str, str]]:
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "KMP_BLOCKTIME", "OMP_WAIT_POLICY")}
    tcmalloc = tcmalloc_path()
    if tcmalloc is None:
        sys.exit("no tcmalloc: apt-get install libtcmalloc-minimal4")
    table = {
        "gomp": base,
        "gomp_tcmalloc": base | {"LD_PRELOAD": tcmalloc},
        "gomp_active": base | {"OMP_WAIT_POLICY": "ACTIVE"},
        "iomp_tcmalloc": base | {"LD_PRELOAD": suggested_preload(iomp)},
        "iomp_tcmalloc_bt0": base | {"LD_PRELOAD": suggested_preload(iomp), "KMP_BLOCKTIME": "0"},
    }
    unknown = [n for n in names if n not in table]
    if unknown:
        sys.exit(f"unknown arms {unknown}; known: {list(table)}")
    return {n: table[n] for n in names}


def main(repeats: int, out: str, arms: list[str], modes: list[str], iomp: Path) -> None:
    if not iomp.is_file():
        sys.exit(f"no {iomp}: give IOMP (intel-openmp's libiomp5.so)")
    envs = arm_envs(arms, iomp)
    job = sitting_job(load_prompts(None)[:8])
    log = Path(out).with_suffix(".log")
    log.write_text("")
    workers = {}
    runs: dict[str, dict[str, list[dict]]] = {mode: {arm: [] for arm in envs} for mode in modes}
    try:
        for arm, env in envs.items():
            print(f"loading {arm}", flush=True)
            workers[arm] = Resident(arm, TANDEM_SIDE, job, log, env, say=print)
        for repeat in range(repeats):
            order = arms[repeat % len(arms):] + arms[: repeat % len(arms)]
            for mode in modes:
                for arm in order:
                    time.sleep(SETTLE_SECONDS)
                    prompts = list(range(8)) if mode.endswith("b8") else [repeat % 8]
                    result = workers[arm].ask({"mode": mode, "prompts": prompts})
                    result.pop("outputs")
                    runs[mode][arm].append(result)
                    print(repeat, mode, arm, result["tokens"], result["seconds"], result["tok_s"], flush=True)
    finally:
        for worker in workers.values():
            worker.close()
    report: dict = {"repeats": repeats, "iomp": str(iomp), "arms": {a: {k: envs[a][k] for k in
                    ("LD_PRELOAD", "KMP_BLOCKTIME", "OMP_WAIT_POLICY") if k in envs[a]} for a in arms},
                    "job": {k: v for k, v in job.items() if k != "texts"},
                    "loaded": {arm: w.loaded for arm, w in workers.items()}, "modes": {}}
    first = arms[0]
    for mode, by_arm in runs.items():
        tok_s = {arm: sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs) for arm, rs in by_arm.items()}
        report["modes"][mode] = {
            "tok_s": {arm: round(t, 3) for arm, t in tok_s.items()},
            f"over_{first}": {arm: round(t / tok_s[first], 4) for arm, t in tok_s.items()},
            "ratio_each": {arm: [round(b["tok_s"] / a["tok_s"], 3) for a, b in zip(by_arm[first], rs, strict=True)]
                           for arm, rs in by_arm.items()},
            "tokens": {arm: [r["tokens"] for r in rs] for arm, rs in by_arm.items()},
            "runs": by_arm}
        print(mode, json.dumps({k: v for k, v in report["modes"][mode].items() if k != "runs"}), flush=True)
    with open(out, "w") as sink:
        json.dump(report, sink, indent=1)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3].split(","),
         sys.argv[4].split(",") if len(sys.argv) > 4 else ["plain_b8"],
         Path(sys.argv[5] if len(sys.argv) > 5 else ".venv/lib/libiomp5.so"))
