"""Whether the engine thread waiting for the event loop between steps (TANDEM_SETTLE=1: gateway.loop) closes the
gap of served plain decoding at 8 in flight: two `tandem serve --in-process` servers with the vLLM sittings'
configuration (served-vs-engine-v1.py), one without and one with the wait, and the same engines in a resident process,
asked in turn (the order reversed on odd repeats, the sitting's 1.5 s pause before each run).

Pairs: OFF (plain) and AUTO, the 8 shipped prompts at once (served: 8 in flight), 128 tokens, greedy; auto_b1: AUTO,
the first 4 prompts one after another. SIDES: which of served, settled and engine run (all three by
default).

    PYTHONPATH=services .venv/bin/python docs/bench/served-settle-v1.py REPEATS OUT.json [PAIRS [SIDES [ray]]]
    # e.g. ... 3 b.json plain_b8,auto_b8,auto_b1 served,settled

With `ray`, the servers run their engines over the Ray workers `tandem serve` starts on this host (no --in-process).
"""

from __future__ import annotations

import asyncio
import json
import os
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

sys.path.insert(0, str(Path(__file__).parent))
served_vs_engine = __import__("served-vs-engine-v1")

PAIRS = {"plain_b8": ("off", 8, 8), "auto_b8": ("auto", 8, 8), "auto_b1": ("auto", 1, 4)}  # speculation, flight, n


def main(repeats: int, out: str, pairs: list[str], sides: list[str], in_process: bool = True) -> None:
    texts = load_prompts(None)[:8]
    job = sitting_job(texts)
    log = Path(out).with_suffix(".log")
    log.write_text("")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "TANDEM_SETTLE")}
    env["LD_PRELOAD"] = suggested_preload()
    servers, engine = {}, None
    runs: dict[str, dict[str, list[dict]]] = {pair: {side: [] for side in sides} for pair in pairs}
    try:
        for side, settle in (("served", "0"), ("settled", "1")):  # one at a time: each compiles at its start
            if side not in sides:
                continue
            proc, address = served_vs_engine.start_server(job, env | {"TANDEM_SETTLE": settle}, log, in_process)
            servers[side] = (proc, address)
            wait_serving(proc, address, log)
            for speculation in ("off", "auto"):  # untimed: the server's first batches of 8
                asyncio.run(run_level(address, texts, 8, 16, speculation, -1))
            print(side, "ready", flush=True)
        if "engine" in sides:
            engine = Resident("engine", TANDEM_SIDE, job, log, env, say=print)
        for repeat in range(repeats):
            order = [(pair, side) for pair in pairs for side in sides]
            for pair, side in order[:: -1 if repeat % 2 else 1]:
                speculation, flight, n = PAIRS[pair]
                time.sleep(SETTLE_SECONDS)
                if side == "engine":
                    result = served_vs_engine.ask_engine(engine, pair, flight, n)
                else:
                    result = asyncio.run(run_level(servers[side][1], texts[:n], flight, job["max_tokens"], speculation,
                                                   repeat))
                runs[pair][side].append(result)
                print(repeat, pair, side, result["tokens"], round(result["seconds"], 2), round(result["tok_s"], 2),
                      flush=True)
    finally:
        if engine is not None:
            engine.close()
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(60)
    report: dict = {"repeats": repeats, "in_process": in_process, "job": {k: v for k, v in job.items() if k != "texts"},
                    "preload": env["LD_PRELOAD"], "pairs": {}}
    for pair, sides in runs.items():
        tok_s = {side: sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs) for side, rs in sides.items()}
        compared = [(a, b) for a, b in (("settled", "served"), ("served", "engine"), ("settled", "engine"))
                    if a in sides and b in sides]
        report["pairs"][pair] = {
            "tok_s": {side: round(t, 3) for side, t in tok_s.items()},
            **{f"{a}_over_{b}": round(tok_s[a] / tok_s[b], 4) for a, b in compared},
            "each": {f"{a}_over_{b}": [round(x["tok_s"] / y["tok_s"], 3) for x, y in zip(sides[a], sides[b],
                                                                                          strict=True)]
                     for a, b in compared},
            "tokens": {side: [r["tokens"] for r in rs] for side, rs in sides.items()}, "runs": sides}
        print(pair, json.dumps({k: v for k, v in report["pairs"][pair].items() if k != "runs"}), flush=True)
    with open(out, "w") as sink:
        json.dump(report, sink, indent=1)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], (sys.argv[3] if len(sys.argv) > 3 else "plain_b8,auto_b8").split(","),
         (sys.argv[4] if len(sys.argv) > 4 else "served,settled,engine").split(","),
         in_process=sys.argv[5:6] != ["ray"])
