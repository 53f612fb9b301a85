"""Multi-step decoding (EngineConfig.decode_steps) against a token a call: plain decoding of the real target, in this
process or through a Ray target replica, at batch 1 and with every prompt at once, alternated.

Each repeat runs both engines over the shipped chat prompts (one at a time, then all at once; the next repeat in the
reverse order) after a short warm-up each. Reported per engine and shape: tok/s, verifier calls per token, and
whether the greedy tokens equal the one-step engine's. One JSON out.

    python -m tandem.bench.decode_steps --steps 8 --repeats 2 --json decode-steps.json
    python -m tandem.bench.decode_steps --steps 8 --repeats 2 --ray --json decode-steps-ray.json
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

import torch

from tandem.bench.prompts import DEFAULT_PROMPTS, PROMPT_SETS, load_prompts
from tandem.cli.common import DEFAULT_TARGET
from tandem.cli.options import (
    DefaultsHelpFormatter,
    add_json_option,
    add_prompts_option,
    at_least,
    refuse_bad_values,
    wants_text,
    write_json,
)
from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.core.detok import decoder
from tandem.core.engine import SpeculativeEngine
from tandem.engines.local import build_engine, encode_prompt
from tandem.models.loader import load_model

TARGET = DEFAULT_TARGET


class _CountedCalls:
    """Wraps a verifier's verify to count calls (the engine's round trips to the target)."""

    def __init__(self, engine: SpeculativeEngine) -> None:
        self.calls = 0
        verify = engine.verifier.verify

        def counted(requests):
            self.calls += 1
            return verify(requests)
        engine.verifier.verify = counted


def _engines(target, steps: int, ray_replica: bool, threads: int) -> dict[str, SpeculativeEngine]:
    configs = {"one": EngineConfig(spec=SpecConfig(enabled=False), calibrate=False),
               f"steps{steps}": EngineConfig(spec=SpecConfig(enabled=False), calibrate=False, decode_steps=steps)}
    if not ray_replica:
        return {name: build_engine(target, None, config) for name, config in configs.items()}
    import ray

    from tandem.models.loader import eos_token_ids
    from tandem.workers.target_pool import RayVerifier, start_target_replicas
    from tandem.workers.worker_base import WorkerConfig

    # address="local": always a cluster of our own on loopback, never one this machine already runs (RAY_ADDRESS or
    # `ray start`), which refuses num_cpus and would run the replica beside its other work.
    ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=threads, include_dashboard=False,
             log_to_driver=False)
    replica = start_target_replicas(WorkerConfig(model=TARGET, device="cpu", dtype="bfloat16", threads=threads), 1)
    ray.get(replica[0].info.remote())  # loaded
    eos, decode = eos_token_ids(target.model, target.tokenizer), decoder(target.tokenizer)
    return {name: SpeculativeEngine(RayVerifier(replica), None, config, eos, decode)
            for name, config in configs.items()}


def _run(engine: SpeculativeEngine, counter: _CountedCalls, ids: list[list[int]], tokens: int, at_once: bool) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=tokens)
    calls = counter.calls
    started = time.perf_counter()
    if at_once:
        outputs = [r.token_ids for r in engine.generate(ids, params)]
    else:
        outputs = [engine.generate([prompt], params)[0].token_ids for prompt in ids]
    seconds = time.perf_counter() - started
    emitted = sum(map(len, outputs))
    return {"tokens": emitted, "seconds": round(seconds, 3), "tok_s": round(emitted / seconds, 3),
            "calls": counter.calls - calls, "loadavg_1m": round(os.getloadavg()[0], 2), "outputs": outputs}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="decode_steps of the multi-step engine")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each engine, the order reversed each repeat")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per request")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (of the Ray replica with --ray)")
    parser.add_argument("--ray", action="store_true", help="verify through a Ray target replica in its own process")
    add_prompts_option(parser, PROMPT_SETS, DEFAULT_PROMPTS)
    add_json_option(parser, "the report")
    args = parser.parse_args(argv)
    # --steps 1 is the single-step engine itself: the A/B would compare it with itself
    refuse_bad_values(parser, at_least(args, steps=2, repeats=1, tokens=1, threads=1))
    torch.set_num_threads(args.threads)
    target = load_model(TARGET, device=torch.device("cpu"), dtype=torch.bfloat16, progress=False)
    ids = [encode_prompt(target.tokenizer, text, chat=True) for text in load_prompts(args.prompts)]
    engines = _engines(target, args.steps, args.ray, args.threads)
    counters = {name: _CountedCalls(engine) for name, engine in engines.items()}
    report: dict = {"command": "python -m tandem.bench.decode_steps " + shlex.join(sys.argv[1:] if argv is None
                                                                                     else argv),
                    "target": TARGET, "dtype": "bfloat16", "threads": args.threads, "tokens": args.tokens,
                    "prompts": len(ids), "verifier": "ray replica" if args.ray else "in process", "runs": []}
    for engine in engines.values():
        engine.generate(ids[:2], SamplingParams(temperature=0.0, max_tokens=2 * args.steps))  # warm-up
    outputs: dict[tuple[str, str], list] = {}
    for repeat in range(args.repeats):
        for shape in ("batch1", "at_once"):
            for name in list(engines) if repeat % 2 == 0 else list(engines)[::-1]:
                run = _run(engines[name], counters[name], ids, args.tokens, shape == "at_once")
                outputs[name, shape] = run.pop("outputs")
                report["runs"].append({"engine": name, "shape": shape, "repeat": repeat} | run)
                if wants_text(args):
                    print(f"{name} {shape}: {run}", flush=True)
    many = f"steps{args.steps}"
    for shape in ("batch1", "at_once"):
        summary = {}
        for name in engines:
            runs = [r for r in report["runs"] if r["engine"] == name and r["shape"] == shape]
            tokens, seconds = sum(r["tokens"] for r in runs), sum(r["seconds"] for r in runs)
            summary[name] = {"tok_s": round(tokens / seconds, 3), "calls_per_token": round(
                sum(r["calls"] for r in runs) / tokens, 4)}
        paired = {r["repeat"]: r["tok_s"] for r in report["runs"] if r["engine"] == many and r["shape"] == shape}
        ones = {r["repeat"]: r["tok_s"] for r in report["runs"] if r["engine"] == "one" and r["shape"] == shape}
        summary["steps_vs_one"] = round(summary[many]["tok_s"] / summary["one"]["tok_s"], 3)
        summary["steps_vs_one_by_repeat"] = [round(paired[r] / ones[r], 3) for r in sorted(paired)]
        summary["greedy_identical"] = outputs[many, shape] == outputs["one", shape]
        report[shape] = summary
    write_json(args.json, report)


if __name__ == "__main__":
    main()
