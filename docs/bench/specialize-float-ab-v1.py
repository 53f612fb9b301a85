"""Floats specialised in tracing (core.cuda_graphs.with_trace_settings, 925ce7c) against left symbolic, as dynamic
shapes have them: a compiled runner's warm-up in fresh processes over an empty inductor cache (cold) and then over
the same cache again (warm), dynamo's restarted analyses, and the compiled one-row decode forward's speed over an
eager runner's on the same model, timed call by call alternated in the same process.

Each round runs both variants, cold then warm, the variants' order alternating from round to round (and, with
--symbolic-first, starting with the symbolic one); every run is its own process, so what a warm run reuses is only
inductor's cache directory. The symbolic variant sets dynamo's specialize_float back to False inside the trace
settings, around the compiled call, and changes nothing else. The report is rewritten after every run.

    PYTHONPATH=services python docs/bench/specialize-float-ab-v1.py --model tiny-target --rounds 2 --json ...
    PYTHONPATH=services python docs/bench/specialize-float-ab-v1.py --model qwen2.5-coder-0.5b-instruct \
        --quantization w4 --dtype bfloat16 --rounds 1 --json ...      # 47 min on CPU-B
    # a second sitting: the same command with --append (its rounds join the report, the order alternating on)
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

VARIANTS = ("specialised", "symbolic")
TINY = {"tiny-target": "target", "tiny-draft": "draft"}


def keep_floats_symbolic() -> None:
    """Wrap every compiled call so that, inside tandem's trace settings, dynamo's specialize_float is False again."""
    from torch._dynamo import config as dynamo_config

    from tandem.core import cuda_graphs

    specialised = cuda_graphs.with_trace_settings

    def symbolic(compiled):
        def call(*args):
            dynamo_config.specialize_float = False  # the wrapper restores its caller's value after the call
            return compiled(*args)
        return specialised(call)

    cuda_graphs.with_trace_settings = symbolic


def one_row_forwards(runners: dict, calls: int) -> dict[str, list[float]]:
    """Seconds of `calls` one-row, one-token decode forwards over 100 cached tokens on each runner, the runners
    alternating call by call (their ratio holds up where the machine's load moves between processes)."""
    states = {}
    for name, runner in runners.items():
        state = states[name] = runner.state("bench")
        state.sync(0, [(7 + 13 * j) % runner.vocab_size for j in range(100)])
        runner.prefill(state, len(state.tokens))
    seconds: dict[str, list[float]] = {name: [] for name in runners}
    for call in range(calls + 3):
        for name in (list(runners) if call % 2 == 0 else list(runners)[::-1]):
            state, keep = states[name], states[name].cached
            state.sync(keep, [5])
            started = time.perf_counter()
            runners[name].forward_on_device([state], [1])
            seconds[name].append(time.perf_counter() - started)
            state.sync(keep, [])
    return {name: times[3:] for name, times in seconds.items()}


def run_child(args: argparse.Namespace) -> dict:
    import torch
    from torch._dynamo.utils import compilation_time_metrics

    torch.set_num_threads(args.threads)
    if args.variant == "symbolic":
        keep_floats_symbolic()
    from tandem.core.runner import ModelRunner
    from tandem.models.loader import load_model

    model = args.model
    if model in TINY:
        from tandem.models.tiny import make_tiny

        model = str(getattr(make_tiny(Path(tempfile.mkdtemp(prefix="tandem-tiny-")), seed=0), TINY[model]))
    loaded = load_model(model, device=torch.device("cpu"), dtype=getattr(torch, args.dtype), progress=False,
                        quantization=args.quantization)
    runner = ModelRunner(loaded.model, kv_tokens=4096, compile=True)
    started = time.perf_counter()
    forwards = runner.warm_up()
    seconds = time.perf_counter() - started
    attempts = {key: len(times) for key, times in compilation_time_metrics.items() if key.startswith("compile_attempt")}
    restarts = sum(n for key, n in attempts.items() if key != "compile_attempt_0")
    forward = one_row_forwards({"compiled": runner, "eager": ModelRunner(loaded.model, kv_tokens=4096)}, args.calls)
    compiled, eager = (statistics.median(forward[name]) for name in ("compiled", "eager"))
    return {"seconds": seconds, "forwards": forwards, "compile_error": runner.graphs.compile_error,
            "compile_attempts": attempts, "restarts": restarts, "forward_ms_median": 1e3 * compiled,
            "eager_ms_median": 1e3 * eager, "eager_over_compiled": eager / compiled}


def child(variant: str, cache_dir: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--child", "--variant", variant, "--model", args.model, "--dtype", args.dtype,
               "--quantization", args.quantization, "--threads", str(args.threads), "--calls", str(args.calls)]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{variant} run failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-draft", help="tiny-draft, tiny-target or a model spec")
    parser.add_argument("--quantization", default="none", help="as load_model takes it: none, w8a8, w4")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--symbolic-first", action="store_true",
                        help="the first round runs the symbolic variant first (a second sitting of one round)")
    parser.add_argument("--calls", type=int, default=60, help="timed one-row forwards per runner and run")
    parser.add_argument("--json", help="where the report goes (required)")
    parser.add_argument("--append", action="store_true",
                        help="add this sitting's rounds to the report at --json, its runs kept; the order alternates "
                             "on from its rounds")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(args)), flush=True)
        return
    if not args.json:
        parser.error("--json is required")
    runs: dict[str, dict[str, list[dict]]] = {v: {"cold": [], "warm": []} for v in VARIANTS}
    sittings = [{k: v for k, v in vars(args).items() if k != "child"}]
    if args.append:
        earlier = json.loads(Path(args.json).read_text())
        runs, sittings = earlier["runs"], earlier.get("sittings", [earlier["args"]]) + sittings
    done_before = complete_rounds(runs)
    for round_ in range(done_before, done_before + args.rounds):
        for variant in (VARIANTS if (round_ + args.symbolic_first) % 2 == 0 else VARIANTS[::-1]):
            with tempfile.TemporaryDirectory(prefix="tandem-float-ab-") as cache_dir:
                for kind in ("cold", "warm"):
                    result = child(variant, cache_dir, args)
                    runs[variant][kind].append(result)
                    print(f"round {round_ + 1} {variant} {kind}: {result['seconds']:.1f} s, "
                          f"{result['restarts']} restarts, forward {result['forward_ms_median']:.2f} ms, "
                          f"eager over compiled {result['eager_over_compiled']:.3f}", flush=True)
                    write_report(args, sittings, runs)  # after every run: a sitting cut short keeps its runs


def run_counts(runs: dict[str, dict[str, list[dict]]]) -> list[int]:
    return [len(runs[v][kind]) for v in VARIANTS for kind in ("cold", "warm")]


def complete_rounds(runs: dict[str, dict[str, list[dict]]]) -> int:
    """Rounds in which both variants ran cold and warm."""
    return min(run_counts(runs))


def write_report(args: argparse.Namespace, sittings: list[dict], runs: dict[str, dict[str, list[dict]]]) -> None:
    """The runs so far, and the ratios over the rounds where both variants ran."""
    rounds = complete_rounds(runs)

    def total(variant: str, kind: str) -> float:
        return sum(r["seconds"] for r in runs[variant][kind][:rounds])

    def forward(variant: str) -> float:
        """The compiled forward's speed-up over eager in the same process, median over the variant's runs."""
        return statistics.median(r["eager_over_compiled"] for kind in ("cold", "warm")
                                 for r in runs[variant][kind][:rounds])

    report = {"what": __doc__.split("\n\n")[0], "args": sittings[0], "sittings": sittings, "complete_rounds": rounds,
              "runs": runs}
    if rounds:
        report |= {"symbolic_over_specialised": {kind: total("symbolic", kind) / total("specialised", kind)
                                                 for kind in ("cold", "warm")},
                   "eager_over_compiled": {v: forward(v) for v in VARIANTS},
                   "compiled_forward_specialised_over_symbolic": forward("specialised") / forward("symbolic")}
        if max(run_counts(runs)) == rounds:  # no round half run: the sitting's summary line
            print(json.dumps({k: report[k] for k in ("symbolic_over_specialised", "eager_over_compiled",
                                                     "compiled_forward_specialised_over_symbolic")}))
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
