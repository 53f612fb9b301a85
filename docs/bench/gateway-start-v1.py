"""How long a `tandem gateway --pools` takes from its process's start until it reports ready (grpc.health.v1
SERVING), its resident memory then, and which of torch and transformers it imported. Each checkout (`--services`:
this one and a worktree of an older commit) starts pools of its own on a Ray head of its own, whose workers import
that checkout, and its gateways attach to those; the checkouts take turns, their order alternating round by round.

    git worktree add /tmp/old d79ce31
    PYTHONPATH=services python docs/bench/gateway-start-v1.py --services /tmp/old/services services \\
        --target qwen2.5-coder-1.5b-instruct --json start.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tandem.bench.local_cluster import checkout_heads, ray_env, wait_serving

# `tandem ARGV` that writes, at exit, the top-level packages it imported to $IMPORTS_FILE.
TANDEM = """
import atexit, json, os, sys
from tandem.cli.main import main

atexit.register(lambda: open(os.environ["IMPORTS_FILE"], "w").write(json.dumps(sorted(
    {"torch", "transformers"} & {name.split(".")[0] for name in sys.modules}))))
sys.exit(main(sys.argv[1:]))
"""


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError(f"no VmRSS for {pid}")


def gateway_start(services: str, address: str, pool: str, temp: str, settle_s: float = 0.0) -> dict:
    """One gateway in a fresh interpreter: seconds until ready, its RSS then (and `settle_s` later, where given:
    what it builds in the background once ready counts there), what it imported (after a SIGTERM)."""
    run = os.path.join(temp, f"gateway-{pool}-{time.monotonic_ns()}")
    env = ray_env(address) | {"PYTHONPATH": services, "HF_HUB_OFFLINE": "1", "IMPORTS_FILE": f"{run}.json"}
    began = time.monotonic()
    with open(f"{run}.err", "w") as errors:
        process = subprocess.Popen([sys.executable, "-c", TANDEM, "gateway", "--pools", pool, "--port", "0",
                                    "--metrics-port", "-1", "--http-port", "-1"], env=env, stdout=subprocess.PIPE,
                                   stderr=errors, text=True)
    try:
        wait_serving(process, Path(f"{run}.err"), timeout_s=600, poll_s=0.05)
        ready_s = time.monotonic() - began
        rss = rss_mib(process.pid)
        settled = {}
        if settle_s:
            time.sleep(settle_s)
            settled = {"rss_settled_mib": rss_mib(process.pid)}
    finally:
        process.terminate()
        process.wait(timeout=120)
    return {"ready_s": round(ready_s, 2), "rss_mib": rss, **settled,
            "imported": json.loads(Path(f"{run}.json").read_text())}


def start_pools(services: str, address: str, pool: str, args: argparse.Namespace) -> float:
    models = ["--target", args.target] + (["--draft", args.draft] if args.draft else ["--no-spec"])
    env = ray_env(address) | {"PYTHONPATH": services, "HF_HUB_OFFLINE": "1"}
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "tandem", "pools", "start", "--name", pool, *models, "--dtype",
                           args.dtype, "--threads", "1"], env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"pools start ({services}): {done.stderr[-2000:]}")
    return round(time.monotonic() - began, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", nargs="+", default=["services"],
                        help="tandem checkouts' services/ directories, each with pools of its own")
    parser.add_argument("--target", default="", help="the pools' target (default: a tiny random model)")
    parser.add_argument("--draft", default="", help="their draft (default: the tiny draft with a tiny target, "
                                                    "else none: plain pools)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=3, help="gateway starts per checkout")
    parser.add_argument("--settle", type=float, default=0.0, help="also read each gateway's RSS this many seconds "
                                                                  "after it is ready")
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    if not args.target:
        from tandem.models.tiny import make_tiny

        tiny = make_tiny(Path(tempfile.mkdtemp(prefix="gws-tiny-")), seed=0)
        args.target, args.draft, args.dtype = str(tiny.target), str(tiny.draft), "float32"
    checkouts = [os.path.abspath(services) for services in args.services]
    report: dict = {"what": __doc__.split("\n\n")[0], "args": vars(args), "checkouts": {}}
    with checkout_heads(checkouts) as heads:
        for services in checkouts:
            report["checkouts"][services] = {"pools_start_s": start_pools(services, heads[services], "p", args),
                                             "starts": []}
        for round_ in range(args.rounds):
            for services in checkouts if round_ % 2 == 0 else checkouts[::-1]:
                report["checkouts"][services]["starts"].append(
                    gateway_start(services, heads[services], "p", tempfile.mkdtemp(prefix="gws-run-"), args.settle))
    for entry in report["checkouts"].values():
        entry["median_ready_s"] = statistics.median(s["ready_s"] for s in entry["starts"])
        entry["median_rss_mib"] = statistics.median(s["rss_mib"] for s in entry["starts"])
        if args.settle:
            entry["median_rss_settled_mib"] = statistics.median(s["rss_settled_mib"] for s in entry["starts"])
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["checkouts"], indent=1))


if __name__ == "__main__":
    main()
