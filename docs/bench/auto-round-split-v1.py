"""Where an 8-at-once run's time goes, plain against AUTO: the engines of the vLLM comparison
(tandem.bench.vllm_compare_tandem.build_engines: the pair compiled, w4 draft, the draft's head cut to 65536 ids,
calibrated and warmed up), the 8 shipped prompts at once, 128 tokens, greedy, the modes alternated (A B B A per
repeat). Each engine's round is timed by parts with wall-clock wrappers around its methods: the draft (of which the
draft model's forwards and its catch-up prefill), the verification (of which the target's forwards and prefill), and
the rest of the round (planning, committing, stops). Per mode: seconds, tokens, rounds, and per round the target's
tokens scored and the draft forwards run.

    PYTHONPATH=services python docs/bench/auto-round-split-v1.py REPEATS OUT.json     # about 4 min a repeat on CPU-A
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from functools import wraps

import torch

from tandem.bench.prompts import load_prompts
from tandem.bench.vllm_compare_tandem import build_engines, sitting_job
from tandem.core.config import SamplingParams


def timed(owner, name: str, totals: Counter, key: str, wrapped: list, on_call=None) -> None:
    """Shadow `owner.name` with a wrapper adding its wall time to totals[key] (and calling on_call(args, result));
    (owner, name) is added to `wrapped`, for the caller to remove."""
    inner = getattr(owner, name)

    @wraps(inner)
    def call(*args, **kwargs):
        started = time.perf_counter()
        result = inner(*args, **kwargs)
        totals[key] += time.perf_counter() - started
        if on_call is not None:
            on_call(args, result)
        return result
    setattr(owner, name, call)
    wrapped.append((owner, name))


def instrument(engine) -> tuple[Counter, Counter, list]:
    """The engine's round and its runners' forwards timed: (totals, shapes, what was wrapped)."""
    totals, shapes, wrapped = Counter(), Counter(), []
    timed(engine, "step", totals, "round_s", wrapped, lambda a, r: totals.update(rounds=1))
    timed(engine, "_draft", totals, "draft_s", wrapped,
          lambda a, r: shapes.update({f"draft_forwards_{max((len(p.tokens) for p in r if p), default=0)}": 1}))
    timed(engine, "_verify", totals, "verify_s", wrapped)
    target = engine.verifier.runner
    timed(target, "forward_on_device", totals, "target_forward_s", wrapped,
          lambda a, r: shapes.update({f"target_rows{len(a[0])}_scored{sum(a[1])}": 1}))
    timed(target, "prefill_many", totals, "target_prefill_s", wrapped)
    if engine.drafter is not None:
        draft = engine.drafter.runner
        timed(draft, "forward_on_device", totals, "draft_forward_s", wrapped)
        timed(draft, "prefill_many", totals, "draft_prefill_s", wrapped)
    return totals, shapes, wrapped


def main(repeats: int, out: str) -> None:
    texts = load_prompts(None)[:8]
    job = sitting_job(texts)
    loaded, engines, ids = build_engines(job)
    runs: dict[str, list[dict]] = {"plain": [], "auto": []}
    for repeat in range(repeats):
        for mode in ("plain", "auto", "auto", "plain") if repeat % 2 == 0 else ("auto", "plain", "plain", "auto"):
            engine = engines[mode]
            totals, shapes, wrapped = instrument(engine)
            started = time.perf_counter()
            results = engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=job["max_tokens"]))
            seconds = time.perf_counter() - started
            for owner, name in wrapped:  # the class's methods again
                delattr(owner, name)
            tokens = sum(len(r.token_ids) for r in results)
            run = {"seconds": round(seconds, 4), "tokens": tokens, "tok_s": round(tokens / seconds, 3),
                   **{k: round(v, 4) for k, v in totals.items()}, "shapes": dict(sorted(shapes.items()))}
            run["round_rest_s"] = round(totals["round_s"] - totals["draft_s"] - totals["verify_s"], 4)
            runs[mode].append(run)
            print(mode, json.dumps({k: v for k, v in run.items() if k != "shapes"}), flush=True)
    summary = {}
    for mode, items in runs.items():
        keys = [k for k in items[0] if k != "shapes"]
        summary[mode] = {k: round(sum(r.get(k, 0) for r in items), 4) for k in keys}
        summary[mode]["tok_s"] = round(summary[mode]["tokens"] / summary[mode]["seconds"], 3)
        for k in ("draft_s", "verify_s", "round_rest_s", "target_forward_s", "draft_forward_s", "draft_prefill_s",
                  "target_prefill_s"):
            summary[mode][k.replace("_s", "_share")] = round(summary[mode].get(k, 0) / summary[mode]["seconds"], 4)
    summary["auto_over_plain"] = round(summary["auto"]["tok_s"] / summary["plain"]["tok_s"], 4)
    costs = engines["auto"].costs  # what the batch plan believed at the end: 8 rows' forwards and draft steps
    summary["priced_8_rows"] = {"target_width_1_s": round(costs.batch_forward_time(8, 1), 5),
                                "target_width_2_s": round(costs.batch_forward_time(8, 2), 5),
                                "target_width_3_s": round(costs.batch_forward_time(8, 3), 5),
                                "draft_step_s": round(costs.draft_time(8), 5)}
    report = {"config": {**{k: v for k, v in job.items() if k != "texts"}, "repeats": repeats,
                         "torch": torch.__version__, "loaded": loaded},
              "summary": summary, "runs": runs}
    with open(out, "w") as sink:
        json.dump(report, sink, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
