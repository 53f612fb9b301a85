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

import os
import sys
from pathlib import Path

from resident_arms import over_first, rotated_runs, write_report

from tandem.bench.prompts import load_prompts
from tandem.bench.vllm_compare_tandem import sitting_job

SETTINGS = {"fma": "kernel-fma", "dot": "kernel-dot", "onednn": "onednn"}


def main(repeats: int, out: str, arms: list[str], modes: list[str]) -> None:
    unknown = [arm for arm in arms if arm not in SETTINGS]
    if unknown:
        sys.exit(f"unknown arms {unknown}; known: {list(SETTINGS)}")
    envs = {arm: os.environ | {"TANDEM_CPU_LINEAR": SETTINGS[arm]} for arm in arms}
    job = sitting_job(load_prompts(None)[:8]) | {"compile": False, "draft_quantization": "auto", "draft_vocab": 0}
    runs, outputs, loaded = rotated_runs(envs, job, Path(out).with_suffix(".log"), repeats, modes)
    first = arms[0]
    report: dict = {"repeats": repeats, "arms": {arm: SETTINGS[arm] for arm in arms},
                    "job": {k: v for k, v in job.items() if k != "texts"},
                    "loaded": loaded, "modes": {}}
    for mode, by_arm in runs.items():
        report["modes"][mode] = over_first(by_arm) | {
            # greedy: the same text on every path, up to bf16 near-ties (the paths round differently)
            f"outputs_equal_{first}": {arm: [a == b for a, b in zip(outputs[mode][first], outs, strict=True)]
                                       for arm, outs in outputs[mode].items()},
            "runs": by_arm}
    write_report(report, out)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3].split(","),
         sys.argv[4].split(",") if len(sys.argv) > 4 else ["plain_b8", "auto_b8"])
