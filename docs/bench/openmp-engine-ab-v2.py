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

import os
import sys
from pathlib import Path

from resident_arms import over_first, rotated_runs, write_report

from tandem.bench.prompts import load_prompts
from tandem.bench.vllm_compare_tandem import sitting_job
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
    runs, _, loaded = rotated_runs(envs, job, Path(out).with_suffix(".log"), repeats, modes)
    report: dict = {"repeats": repeats, "iomp": str(iomp), "arms": {a: {k: envs[a][k] for k in
                    ("LD_PRELOAD", "KMP_BLOCKTIME", "OMP_WAIT_POLICY") if k in envs[a]} for a in arms},
                    "job": {k: v for k, v in job.items() if k != "texts"},
                    "loaded": loaded, "modes": {}}
    for mode, by_arm in runs.items():
        report["modes"][mode] = over_first(by_arm) | {
            "tokens": {arm: [r["tokens"] for r in rs] for arm, rs in by_arm.items()},
            "runs": by_arm}
    write_report(report, out)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3].split(","),
         sys.argv[4].split(",") if len(sys.argv) > 4 else ["plain_b8"],
         Path(sys.argv[5] if len(sys.argv) > 5 else ".venv/lib/libiomp5.so"))
