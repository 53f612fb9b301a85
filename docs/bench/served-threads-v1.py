"""Per-thread CPU seconds and context switches (voluntary, involuntary) of a `tandem serve --in-process` process
(served-vs-engine-v1.py's server, the vLLM sittings' configuration, preloaded) over served runs of the 8 prompts at 8
in flight, OFF and AUTO, 2 repeats, read from /proc before and after each run. One line per run: mode, tokens,
seconds, tok/s, rounds, {thread: [CPU seconds, voluntary, involuntary]} for the threads that ran. Compare
engine-threads-v1.py, the same engines in one process.

    PYTHONPATH=services .venv/bin/python docs/bench/served-threads-v1.py > served-threads.out       # 12 min
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import time
from pathlib import Path

from tandem.bench.prompts import load_prompts
from tandem.bench.serving import run_level
from tandem.bench.vllm_compare_tandem import sitting_job, wait_serving
from tandem.core.cpu_runtime import suggested_preload

TICK = os.sysconf("SC_CLK_TCK")


def thread_counts(pid: int) -> dict[str, tuple[float, int, int]]:
    """{thread id: (CPU seconds, voluntary switches, involuntary switches)} of process `pid`."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat, status = (task / "stat").read_text(), (task / "status").read_text()
        except OSError:  # the thread ended
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[task.name] = ((int(fields[11]) + int(fields[12])) / TICK,
                          int(status.split("voluntary_ctxt_switches:")[1].split()[0]),
                          int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0]))
    return out


def changed(before: dict, after: dict) -> dict[str, list[float]]:
    delta = {k: [round(a - b, 2) for a, b in zip(v, before.get(k, (0, 0, 0)), strict=True)] for k, v in after.items()}
    return {k: v for k, v in delta.items() if v[0] > 0.02 or v[2] > 20}


def main() -> None:
    spec = importlib.util.spec_from_file_location("sve", Path(__file__).with_name("served-vs-engine-v1.py"))
    served = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(served)
    texts = load_prompts(None)[:8]
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"} | {"LD_PRELOAD": suggested_preload()}
    server, address = served.start_server(sitting_job(texts), env, Path("served-threads.log"))
    try:
        wait_serving(server, address, Path("served-threads.log"))
        for speculation in ("off", "auto"):  # untimed: the server's first batches of 8
            asyncio.run(run_level(address, texts, 8, 16, speculation, -1))
        for repeat in range(2):
            for mode in ("off", "auto"):
                time.sleep(1.5)
                before = thread_counts(server.pid)
                result = asyncio.run(run_level(address, texts, 8, 128, mode, repeat))
                delta = changed(before, thread_counts(server.pid))
                print(mode, result["tokens"], result["seconds"], result["tok_s"], result["rounds"],
                      json.dumps(dict(sorted(delta.items(), key=lambda kv: -kv[1][0]))), flush=True)
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
