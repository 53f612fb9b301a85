"""The pace both pools learn (workers.pace) while calibration runs over them: Ray pools for the pair started here
(`tandem serve`'s float32 defaults; run on a9b1155, where they gave each worker one thread), then each pool's learned
seconds per token, its allowance per token against the fixed one, and the deadline of a call carrying 2000 tokens
under each.

    PYTHONPATH=services python docs/bench/pool-pace-v1.py --json pace.json
"""

from __future__ import annotations

import argparse
import json
import time

from tandem.core.config import EngineConfig
from tandem.engines import Arm, BuildOptions, ClusterOptions, build
from tandem.engines.cluster import start_ray


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2000, help="the tokens of the call whose deadline is shown")
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    options = ClusterOptions(dtype=args.dtype)
    start_ray(options)
    started = time.perf_counter()
    engine = build(BuildOptions(args.target, (Arm("", args.draft, EngineConfig(max_batch=args.max_batch)),),
                                options))[""].engine
    report = {"args": vars(args), "build_and_calibrate_s": round(time.perf_counter() - started, 1), "pools": {}}
    for name, pool in (("target", engine.verifier), ("draft", engine.drafter)):
        allowance = pool.pace.allowance(pool.per_token_s)
        report["pools"][name] = {
            "pace_s_per_token": round(pool.pace.per_token, 5), "allowance_s_per_token": round(allowance, 5),
            "fixed_s_per_token": pool.per_token_s, "base_s": pool.timeout_s,
            f"deadline_{args.tokens}_tokens_s": round(pool.timeout_s + allowance * args.tokens, 1),
            f"fixed_deadline_{args.tokens}_tokens_s": round(pool.timeout_s + pool.per_token_s * args.tokens, 1)}
    print(json.dumps(report, indent=1))
    with open(args.json, "w") as out:
        json.dump(report, out, indent=1)


if __name__ == "__main__":
    main()
