"""Shared pools measured: one gateway with N sessions against two gateways with N/2 each, on the same pools.

Starts a Ray head on loopback (or joins --ray-address), `tandem pools start` with one draft worker and one target
replica, and the gateways as separate `tandem gateway` processes; runs the configurations alternately, --repeats
times, each as N concurrent greedy streams of --max-tokens (chat prompts); reads rows per verify forward from the
target worker's counters. JSON on stdout (and --json PATH):

    python -m tandem.bench.pools --sessions 8 --max-tokens 128 --repeats 2 --json docs/bench/pools-v2.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

from loadtest.prompts import load_set
from tandem.bench.local_cluster import (
    BIN,
    greedy_streams,
    pools_status,
    ray_env,
    run_tandem,
    start_gateway,
    start_ray_head,
)
from tandem.cli.options import DefaultsHelpFormatter, add_json_option, wants_text, write_json


def _target_counters(address: str, pools: str) -> tuple[int, int]:
    status = pools_status(address, pools)
    # rows and forwards are cumulative on the worker; status reports recent means, so read them from info here.
    target = next(w for w in status["workers"] if w["role"] == "target")
    return target["rows"], target["forwards"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--ray-address", default=None, help="join this cluster (default: start a head here)")
    parser.add_argument("--sessions", type=int, default=8, help="concurrent greedy streams")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per stream")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each configuration, alternated")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--pool-args", default="", help="more `tandem pools start` flags, one string")
    add_json_option(parser, "the report")
    args = parser.parse_args(argv)

    address, head = args.ray_address, None
    if address is None:
        head, address = start_ray_head(tempfile.mkdtemp(prefix="tandem-ray-"))
    gateways: list[subprocess.Popen] = []
    try:
        run_tandem(address, "pools", "start", "--name", "bench", "--threads", str(args.threads), "--draft-workers",
                   "1", "--target-replicas", "1", *args.pool_args.split())
        one, two_a, two_b = (start_gateway(address, "bench", started=gateways).address for _ in range(3))
        prompts = (load_set("chat") * args.sessions)[: args.sessions]
        configs = {"one_gateway": [one], "two_gateways": [two_a, two_b]}
        greedy_streams([one, two_a], prompts[:2], 16)  # warm-up: every gateway's first round on the pools
        runs: list[dict] = []
        for repeat in range(args.repeats):
            order = list(configs) if repeat % 2 == 0 else list(reversed(configs))
            for name in order:
                rows0, forwards0 = _target_counters(address, "bench")
                result = greedy_streams(configs[name], prompts, args.max_tokens)
                rows1, forwards1 = _target_counters(address, "bench")
                result |= {"config": name, "repeat": repeat,
                           "rows_per_verify_forward": round((rows1 - rows0) / max(1, forwards1 - forwards0), 3)}
                print(json.dumps({k: v for k, v in result.items() if k != "outputs"}), file=sys.stderr, flush=True)
                runs.append(result)
        report = _summarise(runs, args, pools_status(address, "bench"))
    finally:
        for process in gateways:
            process.terminate()
        if head is not None:
            head.terminate()
            head.wait(timeout=120)
        else:
            subprocess.run([str(BIN / "tandem"), "pools", "stop", "--name", "bench"], env=ray_env(address),
                           capture_output=True)
    if wants_text(args):
        print(json.dumps(report, indent=2))
    write_json(args.json, report)
    return 0


def _summarise(runs: list[dict], args: argparse.Namespace, status: dict) -> dict:
    def mean(config: str, key: str) -> float:
        values = [r[key] for r in runs if r["config"] == config]
        return sum(values) / len(values)

    reference = next(r["outputs"] for r in runs if r["config"] == "one_gateway")
    return {
        "command": "python -m tandem.bench.pools " + " ".join(sys.argv[1:]),
        "sessions": args.sessions, "max_tokens": args.max_tokens, "threads_per_worker": args.threads,
        "worker_actors": len(status["workers"]),
        "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in runs],
        "tok_s": {c: round(mean(c, "tok_s"), 3) for c in ("one_gateway", "two_gateways")},
        "rows_per_verify_forward": {c: round(mean(c, "rows_per_verify_forward"), 3)
                                    for c in ("one_gateway", "two_gateways")},
        "two_over_one_tok_s": round(mean("two_gateways", "tok_s") / mean("one_gateway", "tok_s"), 3),
        "two_over_one_rows": round(mean("two_gateways", "rows_per_verify_forward")
                                   / mean("one_gateway", "rows_per_verify_forward"), 3),
        "greedy_outputs_equal_across_runs": all(r["outputs"] == reference for r in runs),
    }


if __name__ == "__main__":
    sys.exit(main())
