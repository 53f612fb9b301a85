"""Interactive traffic beside background load, both from `loadtest` (python -m loadtest's Driver), by the
background's priority. One `tandem serve --in-process` (real pair, bf16, AUTO, --max-batch 4) over gRPC.

Each run sends two loads at once: background, 12 requests all at once (128 tokens, code prompts, `--priority` 0 or
1), and interactive, 6 requests as Poisson arrivals at 0.25/s (48 tokens, chat prompts, priority 0). `fcfs` sends
the background at priority 0 (the default: one queue in arrival order), `priority` at 1. The order alternates
(fcfs priority priority fcfs ...), 2 rounds. Reported per run: the interactive requests' time to first token and
end-to-end latency (p50, p90, max), and the background's duration and output tokens/s.

    PYTHONPATH=services python docs/bench/priority-loadtest-v1.py docs/bench/priority-loadtest-v1.json   # ~8 min
"""
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

from loadtest.client_run import Driver
from loadtest.config import RunConfig
from loadtest.metrics import compute
from tandem.bench.local_cluster import serve_process

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
ROUNDS = 2


def configs(address: str, background_priority: int, seed: int) -> tuple[RunConfig, RunConfig]:
    common = {"address": address, "ignore_eos": True, "warmup": 0, "seed": seed}
    background = RunConfig(requests=12, rate=float("inf"), max_tokens=128, prompts="code", lengths=("short", "medium"),
                           priority=background_priority, **common)
    interactive = RunConfig(requests=6, rate=0.25, max_tokens=48, prompts="chat", lengths=("short",), **common)
    return background, interactive


async def both(background: RunConfig, interactive: RunConfig) -> tuple:
    return await asyncio.gather(Driver(background).run(), Driver(interactive).run())


def run(address: str, way: str, seed: int) -> dict:
    background, interactive = configs(address, 1 if way == "priority" else 0, seed)
    traces = asyncio.run(both(background, interactive))
    back, inter = (compute(trace) for trace in traces)
    assert back["completed"] == 12 and inter["completed"] == 6, (back["error_kinds"], inter["error_kinds"])
    latencies = sorted(r.latency for r in traces[1].requests)
    firsts = sorted(r.ttft for r in traces[1].requests)
    return {"interactive": {"ttft_p50_s": round(inter["ttft"]["p50"], 3), "ttft_p90_s": round(inter["ttft"]["p90"], 3),
                            "ttft_max_s": round(firsts[-1], 3), "e2el_p50_s": round(inter["e2el"]["p50"], 3),
                            "e2el_max_s": round(latencies[-1], 3)},
            "background": {"duration_s": round(back["duration"], 3),
                           "output_tokens_per_s": round(back["output_throughput"], 2)}}


ways = ("fcfs", "priority")
flags = ["--target", TARGET, "--draft", DRAFT, "--in-process", "--dtype", "bfloat16", "--threads", "2",
         "--max-batch", "4"]
rounds = []
with tempfile.TemporaryDirectory() as scratch, serve_process(flags, Path(scratch) / "serve.log",
                                                             timeout_s=1800) as (address, _):
    run(address, "priority", 99)  # warm-up
    for index in range(ROUNDS):
        order = ways if index % 2 == 0 else ways[::-1]
        row = {"order": list(order)}
        for way in order:
            row[way] = run(address, way, seed=index)
        rounds.append(row)
        print(json.dumps(row), flush=True)


def mean(way: str, part: str, key: str) -> float:
    return round(statistics.mean(row[way][part][key] for row in rounds), 3)


summary = {way: {"interactive": {key: mean(way, "interactive", key) for key in rounds[0][way]["interactive"]},
                 "background": {key: mean(way, "background", key) for key in rounds[0][way]["background"]}}
           for way in ways}
summary["ttft_p50_fcfs_over_priority"] = [round(row["fcfs"]["interactive"]["ttft_p50_s"]
                                                / row["priority"]["interactive"]["ttft_p50_s"], 2) for row in rounds]
summary["background_tokens_per_s_priority_over_fcfs"] = [
    round(row["priority"]["background"]["output_tokens_per_s"] / row["fcfs"]["background"]["output_tokens_per_s"], 3)
    for row in rounds]
result = {"setup": {"target": TARGET, "draft": DRAFT, "dtype": "bfloat16", "threads": 2, "max_batch": 4,
                    "background": "12 code prompts at once, 128 tokens", "interactive": "6 chat prompts, Poisson "
                    "0.25/s, 48 tokens"}, "summary": summary, "rounds": rounds}
print(json.dumps(summary, indent=1))
Path(sys.argv[1]).write_text(json.dumps(result, indent=1) + "\n")
