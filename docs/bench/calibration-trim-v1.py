"""Calibration's own time, the previous module (a file given, e.g. `git show 67de5d7:services/tandem/core/
calibration.py`) against the current one, over the same loaded pair in one process, in the order old, new, new, old;
and the prices each calibration gives the batch plan and the policy (every row count up to --max-batch, widths up
to k_max + 1). Where a target call falls tells which group of shapes it was.

    git show 67de5d7:services/tandem/core/calibration.py > /tmp/calibration_old.py
    PYTHONPATH=services python docs/bench/calibration-trim-v1.py --old /tmp/calibration_old.py --json trim.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time

import torch

from tandem.core.config import EngineConfig
from tandem.core.costs import CostModel
from tandem.engines.local import build_engine
from tandem.models.loader import load_model


def _module(path: str):
    spec = importlib.util.spec_from_file_location("calibration_old", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _prices(costs: CostModel, max_batch: int, k_max: int) -> dict:
    return {"single": {w: costs.forward_time(w) for w in range(1, k_max + 2)},
            "batched": {f"{n}x{w}": costs.batch_forward_time(n, w) for n in range(2, max_batch + 1)
                        for w in range(1, k_max + 2)},
            "draft": {n: costs.draft_time(n) for n in range(1, max_batch + 1)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="the previous core/calibration.py")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    from tandem.core import calibration as new

    old = _module(args.old)
    common = {"device": torch.device("cpu"), "dtype": getattr(torch, args.dtype)}
    engine = build_engine(load_model(args.target, **common), load_model(args.draft, **common),
                          EngineConfig(max_batch=args.max_batch, calibrate=False))
    spec = engine.config.spec
    runs = []
    for name, module in (("old", old), ("new", new), ("new", new), ("old", old)):
        started = time.perf_counter()
        costs = module.calibrate(engine.verifier, engine.drafter, spec.k_max, spec.k_init, args.max_batch)
        seconds = time.perf_counter() - started
        costs.layout = engine.verifier.row_layout  # as the engine prices with them
        runs.append({"module": name, "seconds": round(seconds, 1), "costs": costs.to_dict(),
                     "prices": _prices(costs, args.max_batch, spec.k_max)})
        print(name, round(seconds, 1), flush=True)
    by = {name: [r["seconds"] for r in runs if r["module"] == name] for name in ("old", "new")}
    summary = {"old_s": by["old"], "new_s": by["new"], "new_over_old": round(sum(by["new"]) / sum(by["old"]), 3)}
    print(json.dumps(summary))
    with open(args.json, "w") as out:
        json.dump({"args": vars(args), "threads": torch.get_num_threads(), "summary": summary, "runs": runs}, out,
                  indent=1)


if __name__ == "__main__":
    main()
