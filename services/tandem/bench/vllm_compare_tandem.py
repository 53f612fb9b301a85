"""tandem's half of tandem.bench.vllm_compare: plain and AUTO at batch 1, and N requests at once, in a process of its
own; and the served runs (run_served, which vllm_compare calls itself: `tandem serve` with N requests in flight).

The process is started by tandem.bench.vllm_compare with tandem's Python and the job as JSON:

    python -m tandem.bench.vllm_compare_tandem job.json result.json

job: target, draft (registry names or paths), prompts (texts; the chat template is applied as `tandem bench` does),
jobs (the texts sent at once), max_tokens, threads, repeat, order (["b1", "bN"] or reversed), compile (`--compile`:
compiled decode forwards), draft_quantization (`--draft-quantization`). Batch 1 is tandem.bench.core.run_bench
with methods plain and tandem (AUTO), prompt by prompt interleaved; N at once is one engine.generate call over all
jobs on a plain engine and on an AUTO engine, both bf16 on the CPU. Loading,
calibration and warm-up requests are left out of the timings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch


def batched(engine, ids: list[list[int]], max_tokens: int) -> dict:
    """Every prompt at once through `engine.generate`, greedy: tokens, time, rounds, what was drafted, the outputs."""
    from tandem.core.config import SamplingParams

    started = time.perf_counter()
    results = engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    seconds = time.perf_counter() - started
    tokens = sum(len(r.token_ids) for r in results)
    drafted = sum(r.stats["drafted"] for r in results)
    accepted = sum(r.stats["accepted"] for r in results)
    return {"tokens": tokens, "seconds": round(seconds, 4), "tok_s": round(tokens / seconds, 3),
            "requests": len(ids), "loadavg_1m": round(os.getloadavg()[0], 2),
            "rounds": sum(r.stats["rounds"] for r in results),
            "spec_rounds": sum(r.stats["spec_rounds"] for r in results), "drafted": drafted,
            "alpha": round(accepted / drafted, 4) if drafted else 0.0,
            "outputs": [list(r.token_ids) for r in results]}


def run(job: dict) -> dict:
    import transformers

    from tandem.bench.core import run_bench
    from tandem.core.config import EngineConfig, SamplingParams
    from tandem.engines.local import build_engine, encode_prompt
    from tandem.models.loader import load_pair

    torch.set_num_threads(job["threads"])
    started = time.perf_counter()
    draft, target = load_pair(job["draft"], job["target"], device=torch.device("cpu"),
                              dtype=getattr(torch, job["dtype"]), progress=False, compile=job.get("compile", False),
                              draft_quantization=job.get("draft_quantization", "none"))
    load_seconds = time.perf_counter() - started
    n = len(job["jobs"])
    engines: dict = {}
    ids = [encode_prompt(target.tokenizer, text, chat=True) for text in job["jobs"]]
    modes: dict[str, dict] = {}
    for step in job["order"]:
        if step == "b1":
            report = run_bench(target, draft, job["prompts"], job["max_tokens"], ("plain", "tandem"),
                               EngineConfig(), progress=False)
            modes["plain_b1"] = report["plain"] | {"loadavg_1m": round(os.getloadavg()[0], 2)}
            modes["auto_b1"] = report["tandem"] | {
                key: report[key] for key in ("tandem_vs_plain", "greedy_identical_to_plain", "bound") if key in report}
        else:
            if not engines:  # built once, warmed up with one short batch each
                engines["plain"] = build_engine(target, None, EngineConfig(calibrate=False))
                engines["auto"] = build_engine(target, draft, EngineConfig())
                for engine in engines.values():
                    engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=4))
            for name in ("plain", "auto") if job["repeat"] % 2 == 0 else ("auto", "plain"):
                modes[f"{name}_b{n}"] = batched(engines[name], ids, job["max_tokens"])
        for name in [m for m in modes if m.endswith(f"_{step}")]:
            print(f"tandem {name}: {modes[name]['tokens']} tokens in {modes[name]['seconds']:.2f} s = "
                  f"{modes[name]['tok_s']:.2f} tok/s", file=sys.stderr, flush=True)
    return {"modes": modes, "load_seconds": round(load_seconds, 1),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
            "torch_threads": torch.get_num_threads()}


def run_served(args: argparse.Namespace, prompts: list[str], repeat: int, log: Path,
               say: Callable[[str], None], started: Callable[[int], None] | None = None,
               env: dict[str, str] | None = None, compile: bool = False) -> dict[str, dict]:
    """`tandem serve --in-process` on a free port, then tandem.bench.serving.run_level OFF and AUTO at N in flight;
    run by tandem.bench.vllm_compare itself, the server's output appended to `log`. `started(pid)` is called once
    the server process runs; `env`: the server's environment (None: this process's); `compile`: serve with
    `--compile` (readiness waits for its compiling); the draft is held as `args.draft_quantization` asks, if set."""
    from tandem.bench.serving import run_level
    from tandem.client import TandemClient

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    cmd = [sys.executable, "-m", "tandem", "serve", "--in-process", "--target", args.target, "--draft", args.draft,
           "--device", "cpu", "--dtype", args.dtype, "--threads", str(args.threads), "--port", address.split(":")[1],
           "--no-metrics", "--draft-quantization", getattr(args, "draft_quantization", "none"),
           *(["--compile"] if compile else [])]
    modes: dict[str, dict] = {}
    with log.open("a") as sink:
        sink.write(f"\n==== {' '.join(cmd)}\n")
        sink.flush()
        server = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env)
        if started is not None:
            started(server.pid)
        try:
            with TandemClient(address, timeout=5) as client:
                while True:  # readiness: SERVING (1) once the models are loaded
                    if server.poll() is not None:
                        raise RuntimeError(f"tandem serve exited {server.returncode}; see {log}")
                    try:
                        if client.health_status("tandem.v1.GenerationService") == 1:
                            break
                    except Exception:  # not listening yet
                        pass
                    time.sleep(2)
            for mode in ("off", "auto") if repeat % 2 == 0 else ("auto", "off"):
                result = asyncio.run(run_level(address, prompts, args.batch, args.max_tokens, mode, repeat))
                result["loadavg_1m"] = round(os.getloadavg()[0], 2)  # well above --threads: something else ran
                modes[f"served_{mode}_b{args.batch}"] = result
                say(f"  tandem served_{mode}_b{args.batch}: {result['tokens']} tokens in {result['seconds']:.2f} s"
                    f" = {result['tok_s']:.2f} tok/s")
        finally:
            server.terminate()
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
    return modes


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(run(job)))


if __name__ == "__main__":
    main()
