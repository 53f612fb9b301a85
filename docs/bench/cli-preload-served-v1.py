"""`tandem serve` as a user starts it, against the same with TANDEM_PRELOAD=1: the command runs itself again with
tcmalloc and Intel's OpenMP runtime preloaded (core.cpu_runtime.preload_environment) where it runs on torch's
libgomp and glibc's malloc. (The run in cli-preload-served-v1.json was taken while the preload was the default and
TANDEM_PRELOAD=0 turned it off: the same two environments.)

Resident `tandem serve --in-process` servers, one an arm (the real pair, bf16, 2 threads, the shipped prompts,
greedy, no prefix cache), a third preloaded with KMP_BLOCKTIME=0 (Intel's runtime keeps its threads spinning 200 ms
after a parallel region by default); what each process has mapped, read from /proc; then OFF and AUTO at `--batch`
in flight through each (tandem.bench.serving.run_level), each arm first in turn. And the relaunch's own cost:
`tandem serve --help` timed each way, the arms rotated.

    PYTHONPATH=services python docs/bench/cli-preload-served-v1.py OUT.json [--repeats 6] [--batch 8]   # ~25 min
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tandem.bench.prompts import load_prompts
from tandem.bench.serving import run_level
from tandem.bench.vllm_compare_tandem import wait_serving
from tandem.core import cpu_runtime

ARMS = {"preloaded": {"TANDEM_PRELOAD": "1"}, "preloaded_blocktime0": {"TANDEM_PRELOAD": "1", "KMP_BLOCKTIME": "0"},
        "torch_as_built": {}}
BASE = "torch_as_built"


def environment(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"} | extra
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2] / "services"),
                                                      os.environ.get("PYTHONPATH")]))
    return env


def start(arm: str, log: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "tandem", "serve", "--in-process", "--device", "cpu", "--dtype", "bfloat16",
           "--threads", "2", "--port", str(port), "--http-port", "-1", "--no-metrics", "--no-prefix-cache"]
    sink = log.open("a")
    sink.write(f"\n==== {arm}: {' '.join(cmd)}\n")
    sink.flush()
    return subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=environment(ARMS[arm])), \
        f"127.0.0.1:{port}"


def help_seconds(arm: str) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "tandem", "serve", "--help"], env=environment(ARMS[arm]), check=True,
                   capture_output=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    helps: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for i in range(6):
        for arm in list(ARMS)[i % len(ARMS):] + list(ARMS)[:i % len(ARMS)]:
            helps[arm].append(help_seconds(arm))
    log = Path(tempfile.mkdtemp(prefix="preload-bench-")) / "servers.log"
    servers = {arm: start(arm, log) for arm in ARMS}
    prompts = load_prompts()
    report: dict = {"bench": "cli-preload-served-v1", "batch": args.batch, "max_tokens": args.max_tokens,
                    "log": str(log), "help_s": helps, "runs": []}
    try:
        for arm, (server, address) in servers.items():
            wait_serving(server, address, log)
            report.setdefault("mapped", {})[arm] = cpu_runtime.loaded(Path(f"/proc/{server.pid}/maps").read_text())
            print(f"{arm}: serving, mapped {report['mapped'][arm]}", flush=True)
        for repeat in range(args.repeats):
            order = list(ARMS)[repeat % len(ARMS):] + list(ARMS)[:repeat % len(ARMS)]  # each arm first in turn
            for mode in ("off", "auto"):
                for arm in order:
                    result = asyncio.run(run_level(servers[arm][1], prompts, args.batch, args.max_tokens, mode,
                                                   repeat))
                    report["runs"].append({"arm": arm, "repeat": repeat, **result})
                    print(f"{repeat} {mode} {arm}: {result['tok_s']:.2f} tok/s", flush=True)
    finally:
        for server, _ in servers.values():
            server.terminate()
            server.wait(60)
    summary = {}
    for mode in ("off", "auto"):
        runs = [r for r in report["runs"] if r["speculation"] == mode]
        pooled = {arm: sum(r["tokens"] for r in runs if r["arm"] == arm) /
                  sum(r["seconds"] for r in runs if r["arm"] == arm) for arm in ARMS}
        summary[mode] = {"pooled_tok_s": pooled}
        for arm in ARMS:
            if arm != BASE:
                each = [round(a["tok_s"] / b["tok_s"], 3) for a, b in
                        zip([r for r in runs if r["arm"] == arm], [r for r in runs if r["arm"] == BASE], strict=True)]
                summary[mode][arm] = {"ratio_pooled": round(pooled[arm] / pooled[BASE], 3), "ratio_each_repeat": each}
    summary["help_s_median"] = {arm: round(statistics.median(times), 3) for arm, times in helps.items()}
    report["summary"] = summary
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
