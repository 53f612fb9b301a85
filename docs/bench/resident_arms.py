"""What the engine A/Bs over resident workers share (openmp-engine-ab-v2.py, bf16-linear-path-engines-v1.py): one
resident worker of tandem.bench.vllm_compare_tandem per arm (an environment), loaded one after the other and kept
side by side, then every mode asked of every arm back to back, the arms' order rotated by one between repeats, with
the vLLM sitting's pause before each run; the per-mode summary against the first arm; and the report written. Not a
benchmark itself: the scripts import it from beside them."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tandem.bench.resident import Resident
from tandem.bench.vllm_compare import SETTLE_SECONDS
from tandem.bench.vllm_compare_workers import TANDEM_SIDE


def rotated_runs(envs: dict[str, dict[str, str]], job: dict, log: Path, repeats: int, modes: list[str],
                 ) -> tuple[dict[str, dict[str, list[dict]]], dict[str, dict[str, list]], dict[str, dict]]:
    """(runs[mode][arm]: each run's result without its outputs, outputs[mode][arm], loaded[arm]). A b8 mode asks
    the 8 prompts at once, any other the repeat's one prompt."""
    arms = list(envs)
    log.write_text("")
    workers: dict[str, Resident] = {}
    runs: dict[str, dict[str, list[dict]]] = {mode: {arm: [] for arm in arms} for mode in modes}
    outputs: dict[str, dict[str, list]] = {mode: {arm: [] for arm in arms} for mode in modes}
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
                    outputs[mode][arm].append(result.pop("outputs"))
                    runs[mode][arm].append(result)
                    print(repeat, mode, arm, result["tokens"], result["seconds"], result["tok_s"], flush=True)
    finally:
        for worker in workers.values():
            worker.close()
    return runs, outputs, {arm: worker.loaded for arm, worker in workers.items()}


def over_first(by_arm: dict[str, list[dict]]) -> dict:
    """One mode's tok/s pooled per arm, each arm over the first, and per repeat."""
    first = next(iter(by_arm))
    tok_s = {arm: sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs) for arm, rs in by_arm.items()}
    return {"tok_s": {arm: round(t, 3) for arm, t in tok_s.items()},
            f"over_{first}": {arm: round(t / tok_s[first], 4) for arm, t in tok_s.items()},
            "ratio_each": {arm: [round(b["tok_s"] / a["tok_s"], 3) for a, b in zip(by_arm[first], rs, strict=True)]
                           for arm, rs in by_arm.items()}}


def write_report(report: dict, out: str) -> None:
    """Print each mode's summary (its runs left out) and write the whole report to `out`."""
    for mode, summary in report["modes"].items():
        print(mode, json.dumps({k: v for k, v in summary.items() if k != "runs"}), flush=True)
    with open(out, "w") as sink:
        json.dump(report, sink, indent=1)
