"""Why served OFF at 8 in flight ran 0.86x the in-process plain engine (served-vs-engine-v1.json): the sitting's
engines (tandem.bench.vllm_compare_tandem.build_engines: plain, and AUTO with its drafter) in this process, the 8
shipped prompts, 128 tokens, greedy, arms rotated per repeat, 1.5 s apart:

    plain           the plain engine, every prompt added before the first step (as the comparison runs it)
    auto_off        the AUTO engine with every request at max_k 0, as the server runs speculation OFF
    plain_staggered the plain engine, one prompt added, one step, then the other seven (as requests reach a
                    server's engine thread one by one)
    auto_off_staggered  both

    PYTHONPATH=services .venv/bin/python docs/bench/served-plain-gap-v1.py REPEATS OUT.json [ARMS]  # 8 min + 2 a repeat
"""

from __future__ import annotations

import json
import sys
import time

from tandem.bench.prompts import load_prompts
from tandem.bench.vllm_compare import SETTLE_SECONDS
from tandem.bench.vllm_compare_tandem import build_engines, sitting_job
from tandem.core.config import SamplingParams

ARMS = ["plain", "auto_off", "plain_staggered", "auto_off_staggered"]


def run(engine, ids: list[list[int]], max_k: int | None, staggered: bool) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=128)
    started = time.perf_counter()
    first = 1 if staggered else len(ids)
    seqs = [engine.sequences[engine.add_request(p, params, max_k=max_k)] for p in ids[:first]]
    steps = 0
    if staggered:
        engine.step()
        steps += 1
        seqs += [engine.sequences[engine.add_request(p, params, max_k=max_k)] for p in ids[first:]]
    while engine.sequences:
        engine.step()
        steps += 1
    seconds = time.perf_counter() - started
    results = [engine.result(seq) for seq in seqs]
    return {"seconds": round(seconds, 3), "steps": steps, "tokens": sum(len(r.token_ids) for r in results),
            "drafted": sum(r.stats["drafted"] for r in results)}


def main(repeats: int, out: str, arms: list[str]) -> None:
    texts = load_prompts(None)[:8]
    loaded, engines, ids = build_engines(sitting_job(texts))
    print("loaded", json.dumps(loaded), flush=True)
    table = {"plain": ("plain", None, False), "auto_off": ("auto", 0, False),
             "plain_staggered": ("plain", None, True), "auto_off_staggered": ("auto", 0, True)}
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    for repeat in range(repeats):
        for arm in arms[repeat % len(arms):] + arms[: repeat % len(arms)]:
            mode, max_k, staggered = table[arm]
            time.sleep(SETTLE_SECONDS)
            result = run(engines[mode], ids, max_k, staggered)
            runs[arm].append(result)
            print(repeat, arm, result, flush=True)
    first = arms[0]
    report = {"loaded": loaded, "repeats": repeats, "runs": runs,
              "seconds": {arm: round(sum(r["seconds"] for r in rs), 3) for arm, rs in runs.items()}}
    report[f"time_over_{first}"] = {arm: round(t / report["seconds"][first], 4) for arm, t in report["seconds"].items()}
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}), flush=True)
    with open(out, "w") as sink:
        json.dump(report, sink, indent=1)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2],
         sys.argv[3].split(",") if len(sys.argv) > 3 else ARMS)
