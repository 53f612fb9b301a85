"""tandem's engines on each path of its bf16 kernel (core.bf16_linear), end to end: resident workers of
tandem.bench.vllm_compare_tandem with tandem's defaults (eager, the draft as `--draft-quantization auto` holds it, its
whole head; calibrated and warmed up), one per arm, side by side, asked in turn. Arms (comma-separated; the first
is the base), each a TANDEM_CPU_LINEAR setting:

    fma      kernel-fma: float32 multiply-adds on widened weights (the AVX-512 path CPU-D measured)
    dot      kernel-dot: AVX512-BF16 dot products
    onednn   onednn: oneDNN's prepacked bf16 product

Each repeat runs every mode on every arm back to back, the arms' order rotated by one between repeats, with the
sitting's 1.5 s pause before each run. Per mode: tok/s pooled per arm, each arm over the first, per repeat.

    PYTHONPATH=services .venv/bin/python docs/bench/bf16-linear-path-engines-v1.py REPEATS OUT.json ARMS [MODES]

MODES defaults to plain_b8,auto_b8 (also plain_b1, auto_b1: the repeat's prompt alone).
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

SETTINGS = {"fma": "kernel-fma", "dot": "kernel-dot", "onednn": "onednn"}


def main(repeats: int, out: str, arms: list[str], modes: list[str]) -> None:
    unknown = [arm for arm in arms if arm not in SETTINGS]
    if unknown:
        sys.exit(f"unknown arms {unknown}; known: {list(SETTINGS)}")
    envs = {arm: os.environ | {"TANDEM_CPU_LINEAR": SETTINGS[arm]} for arm in arms}
    job = sitting_job(load_prompts(None)[:8]) | {"compile": False, "draft_quantization": "auto", "draft_vocab": 0}
    log = Path(out).with_suffix(".log")
    log.write_text("")
    workers = {}
    runs: dict[str, dict[str, list[dict]]] = {mode: {arm: [] for arm in arms} for mode in modes}
    outputs: dict[str, dict[str, list]] = {mode: {} for mode in modes}
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
                    outputs[mode].setdefault(arm, []).append(result.pop("outputs"))
                    runs[mode][arm].append(result)
                    print(repeat, mode, arm, result["tokens"], result["seconds"], result["tok_s"], flush=True)
    finally:
        for worker in workers.values():
            worker.close()
    first = arms[0]
    report: dict = {"repeats": repeats, "arms": {arm: SETTINGS[arm] for arm in arms},
                    "job": {k: v for k, v in job.items() if k != "texts"},
                    "loaded": {arm: w.loaded for arm, w in workers.items()}, "modes": {}}
    for mode, by_arm in runs.items():
        tok_s = {arm: sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs) for arm, rs in by_arm.items()}
        report["modes"][mode] = {
            "tok_s": {arm: round(t, 3) for arm, t in tok_s.items()},
            f"over_{first}": {arm: round(t / tok_s[first], 4) for arm, t in tok_s.items()},
            "ratio_each": {arm: [round(b["tok_s"] / a["tok_s"], 3) for a, b in zip(by_arm[first], rs, strict=True)]
                           for arm, rs in by_arm.items()},
            # greedy: the same text on every path, up to bf16 near-ties (the paths round differently)
            f"outputs_equal_{first}": {arm: [a == b for a, b in zip(outputs[mode][first], outs, strict=True)]
                                       for arm, outs in outputs[mode].items()},
            "runs": by_arm}
        print(mode, json.dumps({k: v for k, v in report["modes"][mode].items() if k != "runs"}), flush=True)
    with open(out, "w") as sink:
        json.dump(report, sink, indent=1)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3].split(","),
         sys.argv[4].split(",") if len(sys.argv) > 4 else ["plain_b8", "auto_b8"])
