"""Drafting overlapped with verifying: one gateway's rounds in order (`--lanes 1`) against two engine lanes
(`--lanes 2`, one lane's rows draft while the other's verify), on the same pools, alternated.

The draft worker and the target worker each get one torch thread, and every thread of each is pinned to a core of
its own (emulating separate devices); the gateways and Ray's own processes are left unpinned. N concurrent greedy
chat sessions of --max-tokens each; per run: aggregate tok/s, drafted and accepted tokens, rows per verify forward.
JSON on stdout (and --json PATH):

    python -m tandem.bench.overlap --sessions 8 --max-tokens 128 --repeats 2 --pool-args "--fixed-k 3" \
        --gateway-args "--max-batch 4" --json docs/bench/overlap-capped-v1.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

from loadtest.prompts import load_set
from tandem.bench.local_cluster import (
    greedy_streams,
    pools_status,
    run_tandem,
    start_gateway,
    start_ray_head,
)
from tandem.cli.options import DefaultsHelpFormatter, add_json_option, wants_text, write_json


def _pin(pid: int, core: int) -> int:
    """Pin every thread of `pid` to `core`; returns how many threads were pinned."""
    tasks = os.listdir(f"/proc/{pid}/task")
    for tid in tasks:
        os.sched_setaffinity(int(tid), {core})
    return len(tasks)


def _counters(address: str) -> dict[str, dict]:
    """Each role's cumulative forwards, rows and busy seconds (one worker per role here)."""
    return {w["role"]: w for w in pools_status(address, "overlap")["workers"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--sessions", type=int, default=8, help="concurrent greedy streams")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per stream")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each configuration, alternated")
    parser.add_argument("--lanes", type=int, default=2, help="lanes of the overlapped gateway")
    parser.add_argument("--pool-args", default="", help="more `tandem pools start` flags, one string")
    parser.add_argument("--gateway-args", default="",
                        help="more `tandem gateway` flags for both gateways, one string (e.g. \"--max-batch 4\")")
    parser.add_argument("--no-pin", action="store_true", help="leave the workers unpinned")
    add_json_option(parser, "the report")
    args = parser.parse_args(argv)

    head, address = start_ray_head(tempfile.mkdtemp(prefix="tandem-ray-"))
    gateways: list[subprocess.Popen] = []
    try:
        run_tandem(address, "pools", "start", "--name", "overlap", "--threads", "1", "--draft-workers", "1",
                   "--target-replicas", "1", *args.pool_args.split())
        status = pools_status(address, "overlap")
        pinned = {}
        if not args.no_pin:
            for core, role in enumerate(("draft", "target")):
                worker = next(w for w in status["workers"] if w["role"] == role)
                pinned[role] = {"pid": worker["pid"], "core": core, "threads": _pin(worker["pid"], core)}
        extra = args.gateway_args.split()
        sequential = start_gateway(address, "overlap", ["--lanes", "1", *extra], started=gateways)
        overlapped = start_gateway(address, "overlap", ["--lanes", str(args.lanes), *extra], started=gateways)
        prompts = (load_set("chat") * args.sessions)[: args.sessions]
        configs = {"sequential": sequential.address, "overlapped": overlapped.address}
        for target in configs.values():
            greedy_streams([target], prompts[:2], 16)  # warm-up: each gateway's first rounds
        runs: list[dict] = []
        for repeat in range(args.repeats):
            for name in (list(configs) if repeat % 2 == 0 else list(reversed(configs))):
                before = _counters(address)
                result = greedy_streams([configs[name]], prompts, args.max_tokens)
                after = _counters(address)
                rows, forwards = (after["target"][key] - before["target"][key] for key in ("rows", "forwards"))
                # How busy each worker was over the run: overlap can only shorten a run whose workers wait on each
                # other (sequential: draft + target busy <= 1; overlapped, up to 1 each).
                busy = {role: round((after[role]["busy_s"] - before[role]["busy_s"]) / result["seconds"], 3)
                        for role in ("draft", "target")}
                result |= {"config": name, "repeat": repeat, "busy": busy,
                           "rows_per_verify_forward": round(rows / max(1, forwards), 3)}
                print(json.dumps({k: v for k, v in result.items() if k != "outputs"}), file=sys.stderr, flush=True)
                runs.append(result)
        report = _summarise(runs, args, pinned)
    finally:
        for process in gateways:
            process.terminate()
        head.terminate()
        head.wait(timeout=120)
    if wants_text(args):
        print(json.dumps(report, indent=2))
    write_json(args.json, report)
    return 0


def _summarise(runs: list[dict], args: argparse.Namespace, pinned: dict) -> dict:
    def total(config: str, key: str) -> float:
        return sum(r[key] for r in runs if r["config"] == config)

    tok_s = {c: round(total(c, "tokens") / total(c, "seconds"), 3) for c in ("sequential", "overlapped")}
    reference = next(r["outputs"] for r in runs if r["config"] == "sequential")
    return {
        "command": "python -m tandem.bench.overlap " + shlex.join(sys.argv[1:]),
        "sessions": args.sessions, "max_tokens": args.max_tokens, "lanes": args.lanes, "pinned": pinned,
        "pool_args": args.pool_args, "gateway_args": args.gateway_args,
        "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in runs],
        "tok_s": tok_s, "overlapped_over_sequential": round(tok_s["overlapped"] / tok_s["sequential"], 3),
        "acceptance": {c: round(total(c, "accepted") / max(1, total(c, "drafted")), 3)
                       for c in ("sequential", "overlapped")},
        "drafted_per_round": {c: round(total(c, "drafted") / max(1, total(c, "rounds")), 3)
                              for c in ("sequential", "overlapped")},
        "busy": {c: {role: round(sum(r["busy"][role] * r["seconds"] for r in runs if r["config"] == c)
                                 / total(c, "seconds"), 3) for role in ("draft", "target")}
                 for c in ("sequential", "overlapped")},
        "greedy_outputs_equal_across_runs": all(r["outputs"] == reference for r in runs),
    }


if __name__ == "__main__":
    sys.exit(main())
