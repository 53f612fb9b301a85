"""tandem's half of tandem.bench.vllm_compare: a plain and an AUTO engine loaded once, answering one run at a time;
and the served runs (run_served, which vllm_compare calls itself: `tandem serve` with N requests in flight).

The process is started by tandem.bench.vllm_compare (tandem.bench.resident) with tandem's Python:

    python -m tandem.bench.vllm_compare_tandem job.json RESULT_FD

job: target, draft (registry names or paths), texts (the prompts; the chat template is applied as `tandem bench`
does), max_tokens, threads, dtype, compile (a core.model_options.COMPILE_SCOPES scope: whose decode forwards compile),
draft_quantization (`--draft-quantization`), draft_vocab (`--draft-vocab`; 0 or absent: all ids), lookup (true: two
more engines, the target alone and the pair with `--prompt-lookup`, modes lookup_* and hybrid_*). Each request names
a mode (plain_b1, auto_b1, plain_bN, auto_bN) and the prompts to send in one engine.generate call, greedy, on the
CPU, and may give its own max_tokens. Loading, calibration and warm-up requests are left out of the timings.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
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
            "spec_rounds": sum(r.stats["spec_rounds"] for r in results), "drafted": drafted, "accepted": accepted,
            "alpha": round(accepted / drafted, 4) if drafted else 0.0,
            **{key: sum(r.stats.get(key, 0) for r in results)
               for key in ("lookup_rounds", "accepted_lookup_tokens", "rejected_lookup_tokens")},
            "outputs": [list(r.token_ids) for r in results]}


def sitting_job(texts: list[str]) -> dict:
    """The job of the sittings docs/performance.md reports ("Against vLLM for CPU"): the real pair in bf16 on 2
    threads, 128 tokens, both decoders compiled, the w4 draft with a 65536-id head, as `python -m
    tandem.bench.vllm_compare --compile --draft-quantization w4 --draft-vocab 65536` sends it. Scripts that take one
    phase of a sitting apart (docs/bench) build their engines from it."""
    return {"target": "qwen2.5-coder-1.5b-instruct", "draft": "qwen2.5-coder-0.5b-instruct", "texts": texts,
            "max_tokens": 128, "threads": 2, "dtype": "bfloat16", "compile": "all", "draft_quantization": "w4",
            "draft_vocab": 65536}


def build_engines(job: dict) -> tuple[dict, dict, list[list[int]]]:
    """The pair loaded once, a plain engine and an AUTO engine built and warmed up (untimed): what was loaded, the
    engines by mode ("plain", "auto"), and job["texts"] chat-templated to token ids."""
    import transformers

    from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
    from tandem.engines.local import build_engine, encode_prompt
    from tandem.models.loader import load_pair

    torch.set_num_threads(job["threads"])
    started = time.perf_counter()
    draft, target = load_pair(job["draft"], job["target"], device=torch.device("cpu"),
                              dtype=getattr(torch, job["dtype"]), progress=False, compile=job.get("compile", False),
                              draft_quantization=job.get("draft_quantization", "none"))
    load_seconds = time.perf_counter() - started
    ids = [encode_prompt(target.tokenizer, text, chat=True) for text in job["texts"]]
    # A KV budget for these requests and for calibration (max_batch sequences, forwards up to ~1k tokens wide), not a
    # share of free memory: the other system is loaded beside this one.
    kv_tokens = max(len(ids), EngineConfig().max_batch) * max(1024, max(map(len, ids)) + job["max_tokens"] + 64)
    # Prefix caching off, as vLLM's is here: the warm-up below sends the same prompts as the measured runs.
    engines = {"plain": build_engine(target, None, EngineConfig(calibrate=False), kv_tokens=kv_tokens,
                                     prefix_cache=False),
               "auto": build_engine(target, draft, EngineConfig(spec=SpecConfig(draft_vocab=job.get("draft_vocab", 0))),
                                    kv_tokens=kv_tokens, prefix_cache=False)}
    if job.get("lookup"):  # prompt lookup: the target alone with it, and the pair with it (the AUTO engine's costs)
        lookup = SpecConfig(draft_vocab=job.get("draft_vocab", 0), prompt_lookup=True)
        engines["lookup"] = build_engine(target, None, EngineConfig(spec=lookup, calibrate=False),
                                         kv_tokens=kv_tokens, prefix_cache=False)
        engines["hybrid"] = build_engine(target, draft, EngineConfig(spec=lookup, calibrate=False),
                                         kv_tokens=kv_tokens, prefix_cache=False, costs=engines["auto"].costs)
    for engine in engines.values():  # a short lone request and a short batch: compiling, calibrating, first calls
        engine.generate([ids[0][:8]], SamplingParams(temperature=0.0, max_tokens=job["max_tokens"]))
        engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=4))
    loaded = {"load_seconds": round(load_seconds, 1), "kv_tokens": kv_tokens,
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
              "torch_threads": torch.get_num_threads(),
              "draft_ids_scored": engines["auto"].drafter.runner.vocab_size}
    return loaded, engines, ids


@contextlib.contextmanager
def loading_progress() -> Iterator[None]:
    """While the engines load, tandem's INFO lines (each compiled shape class, calibration) go to stderr as `tandem
    ...` lines, which the comparison echoes (resident.Resident's `echo`): a cold compile of both models is 10-18
    minutes with nothing on the console otherwise. The runs after it log warnings alone, as before."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("tandem (loading) %(message)s"))
    logger = logging.getLogger("tandem")
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


def load(job: dict) -> tuple[dict, Callable[[dict], dict]]:
    """build_engines, and the function that answers one request: {"mode": "plain_..." or "auto_...", "prompts":
    indices into job["texts"]} through that engine in one generate call, greedy, job["max_tokens"] each."""
    with loading_progress():
        loaded, engines, ids = build_engines(job)

    def answer(request: dict) -> dict:
        result = batched(engines[request["mode"].split("_")[0]], [ids[i] for i in request["prompts"]],
                         request.get("max_tokens", job["max_tokens"]))
        print(f"tandem {request['mode']} {request['prompts'][0] if len(request['prompts']) == 1 else 'all'}: "
              f"{result['tokens']} tokens in {result['seconds']:.2f} s = {result['tok_s']:.2f} tok/s",
              file=sys.stderr, flush=True)
        return result

    return loaded, answer


def wait_serving(server: subprocess.Popen, address: str, log: Path) -> None:
    """Until `tandem serve` at `address` reports readiness (SERVING once its models are loaded); RuntimeError if the
    process exits first."""
    from tandem.client import TandemClient

    with TandemClient(address, timeout=5) as client:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"tandem serve exited {server.returncode}; see {log}")
            try:
                if client.health_status("tandem.v1.GenerationService") == 1:
                    return
            except Exception:  # not listening yet
                pass
            time.sleep(2)


def run_served(args: argparse.Namespace, prompts: list[str], repeat: int, log: Path,
               say: Callable[[str], None], started: Callable[[int], None] | None = None,
               env: dict[str, str] | None = None, compile: str = "none") -> dict[str, dict]:
    """`tandem serve --in-process` on a free port, then tandem.bench.serving.run_level OFF and AUTO at N in flight;
    run by tandem.bench.vllm_compare itself, the server's output appended to `log`. `started(pid)` is called once
    the server process runs; `env`: the server's environment (None: this process's); `compile`: serve with
    `--compile` ("all") or `--compile-draft` ("draft"; readiness waits for its compiling); the draft is held as
    `args.draft_quantization` asks, if set."""
    from tandem.bench.serving import run_level

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    cmd = [sys.executable, "-m", "tandem", "serve", "--in-process", "--target", args.target, "--draft", args.draft,
           "--device", "cpu", "--dtype", args.dtype, "--threads", str(args.threads), "--port", address.split(":")[1],
           "--no-metrics", "--calibration-file", "",  # the sitting's own calibration, not costs kept from another
           "--no-prefix-cache",  # as vLLM's is off: every level sends the same prompts again
           "--draft-quantization", getattr(args, "draft_quantization", "none"),
           "--draft-vocab", str(getattr(args, "draft_vocab", 0)),
           *({"all": ["--compile"], "draft": ["--compile-draft"]}.get(compile, []))]
    modes: dict[str, dict] = {}
    with log.open("a") as sink:
        sink.write(f"\n==== {' '.join(cmd)}\n")
        sink.flush()
        server = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env)
        if started is not None:
            started(server.pid)
        try:
            wait_serving(server, address, log)
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
    from tandem.bench.resident import serve

    serve(load)


if __name__ == "__main__":
    main()
