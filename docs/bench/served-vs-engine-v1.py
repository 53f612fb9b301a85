"""What serving costs: `tandem serve --in-process` over gRPC against the same engines called in a process, both with
the vLLM sittings' configuration (the pair compiled, w4 draft, a head of 65536 ids, bf16, 2 threads, tcmalloc and
libiomp5 preloaded), loaded side by side and asked in turn.

Arms, each repeat in this order and reversed on odd repeats, the sitting's 1.5 s pause before each run:
    served_off_b8, engine_plain_b8   the 8 shipped prompts at once (served: 8 in flight, speculation OFF)
    served_auto_b8, engine_auto_b8   the same with AUTO
    served_auto_b1, engine_auto_b1   the first 4 prompts one after another (served: 1 in flight)
128 tokens, greedy, an EOS ends a request. Served requests are chat messages the server templates; the engine gets
the same chat-templated ids. Per pair: tok/s pooled per arm, served over engine, per repeat.

    PYTHONPATH=services .venv/bin/python docs/bench/served-vs-engine-v1.py REPEATS OUT.json     # ~20 min + 3 a repeat
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from tandem.bench.prompts import load_prompts
from tandem.bench.resident import Resident
from tandem.bench.serving import run_level
from tandem.bench.vllm_compare import SETTLE_SECONDS
from tandem.bench.vllm_compare_tandem import sitting_job, wait_serving
from tandem.bench.vllm_compare_workers import TANDEM_SIDE
from tandem.core.cpu_runtime import suggested_preload

PAIRS = {"plain_b8": ("off", 8, 8), "auto_b8": ("auto", 8, 8), "auto_b1": ("auto", 1, 4)}  # speculation, flight, n


def start_server(job: dict, env: dict, log: Path, in_process: bool = True) -> tuple[subprocess.Popen, str]:
    """`tandem serve` with the sitting's configuration: its engine in the gateway (--in-process), or over the Ray
    workers it starts on this host."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "tandem", "serve", *(["--in-process"] if in_process else []),
           "--target", job["target"], "--draft", job["draft"],
           "--device", "cpu", "--dtype", job["dtype"], "--threads", str(job["threads"]), "--port", str(port),
           "--no-metrics", "--draft-quantization", job["draft_quantization"], "--draft-vocab", str(job["draft_vocab"]),
           "--compile", "--calibration-file", "",  # the sitting's own calibration
           "--no-prefix-cache"]  # as the engines in a process: the runs repeat their prompts
    with log.open("a") as sink:
        sink.write(f"\n==== {' '.join(cmd)}\n")
        sink.flush()
        return subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env), f"127.0.0.1:{port}"


def ask_engine(engine: Resident, pair: str, flight: int, n: int) -> dict:
    """The resident engines' run of `pair` over the first n prompts: at once, or one after another (flight 1)."""
    if flight == 1:
        parts = [engine.ask({"mode": pair, "prompts": [i]}) for i in range(n)]
        result = {"tokens": sum(p["tokens"] for p in parts), "seconds": sum(p["seconds"] for p in parts)}
        result["tok_s"] = result["tokens"] / result["seconds"]
        return result
    result = engine.ask({"mode": pair, "prompts": list(range(n))})
    result.pop("outputs", None)
    return result


def main(repeats: int, out: str) -> None:
    texts = load_prompts(None)[:8]
    job = sitting_job(texts)
    log = Path(out).with_suffix(".log")
    log.write_text("")
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"} | {"LD_PRELOAD": suggested_preload()}
    server, address = start_server(job, env, log)
    engine = None
    runs: dict[str, dict[str, list[dict]]] = {pair: {"served": [], "engine": []} for pair in PAIRS}
    try:
        engine = Resident("engine", TANDEM_SIDE, job, log, env, say=print)
        wait_serving(server, address, log)
        print("both loaded", flush=True)
        for speculation in ("off", "auto"):  # untimed: the server's first batches of 8
            asyncio.run(run_level(address, texts, 8, 16, speculation, -1))
        for repeat in range(repeats):
            order = [(pair, side) for pair in PAIRS for side in ("served", "engine")]
            for pair, side in order[:: -1 if repeat % 2 else 1]:
                speculation, flight, n = PAIRS[pair]
                time.sleep(SETTLE_SECONDS)
                if side == "served":
                    result = asyncio.run(run_level(address, texts[:n], flight, job["max_tokens"], speculation, repeat))
                else:
                    result = ask_engine(engine, pair, flight, n)
                runs[pair][side].append(result)
                print(repeat, pair, side, result["tokens"], round(result["seconds"], 2), round(result["tok_s"], 2),
                      flush=True)
    finally:
        if engine is not None:
            engine.close()
        server.terminate()
        server.wait(60)
    report: dict = {"repeats": repeats, "job": {k: v for k, v in job.items() if k != "texts"},
                    "preload": env["LD_PRELOAD"], "pairs": {}}
    for pair, sides in runs.items():
        tok_s = {side: sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs) for side, rs in sides.items()}
        report["pairs"][pair] = {
            "tok_s": {side: round(t, 3) for side, t in tok_s.items()},
            "served_over_engine": round(tok_s["served"] / tok_s["engine"], 4),
            "ratio_each": [round(s["tok_s"] / e["tok_s"], 3) for s, e in zip(sides["served"], sides["engine"],
                                                                              strict=True)],
            "tokens": {side: [r["tokens"] for r in rs] for side, rs in sides.items()}, "runs": sides}
        print(pair, json.dumps({k: v for k, v in report["pairs"][pair].items() if k != "runs"}), flush=True)
    with open(out, "w") as sink:
        json.dump(report, sink, indent=1)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
