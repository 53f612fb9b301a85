"""How much a kept torch.compile cache shortens a runner's start: `ModelRunner.warm_up` in fresh processes, first
over an empty cache directory (cold), then over the same directory again (warm), in pairs.

Every run is its own process, so nothing compiled stays in memory between them: what the warm run reuses is only
what inductor wrote to TORCHINDUCTOR_CACHE_DIR (its compiled graphs and, on a GPU, the Triton kernels beside them),
as a restarted pod finds it under the model store (models.store.use_compile_cache).

    python -m tandem.bench.compile_cache --json docs/bench/compile-cache-v1.json      # tiny model, CPU: ~6 minutes
    python -m tandem.bench.compile_cache --model qwen2.5-coder-1.5b-instruct --device cuda --json ...
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tandem.cli.options import DefaultsHelpFormatter, add_json_option, wants_text, write_json

TINY = "tiny"


def warm_up_once(model: str, device: str, dtype: str) -> dict:
    """Load `model` and time its runner's warm-up in this process (the child's side)."""
    from tandem.core.device import select_device, select_dtype
    from tandem.core.runner import ModelRunner
    from tandem.models.loader import load_model

    if model == TINY:
        from tandem.models.tiny import make_tiny

        model = str(make_tiny(Path(tempfile.mkdtemp(prefix="tandem-tiny-")), seed=0).target)
    where = select_device(device)
    loaded = load_model(model, device=where, dtype=select_dtype(dtype, where), progress=False)
    runner = ModelRunner(loaded.model, compile=True)
    started = time.perf_counter()
    forwards = runner.warm_up()
    return {"seconds": time.perf_counter() - started, "forwards": forwards, "compiled": runner.graphs.compiled,
            "compile_error": runner.graphs.compile_error}


def child(cache_dir: Path, args: argparse.Namespace) -> dict:
    command = [sys.executable, "-m", "tandem.bench.compile_cache", "--child", "--model", args.model,
               "--device", args.device, "--dtype", args.dtype]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--model", default=TINY, help="a model spec as `tandem serve --target` takes it, or tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", help="float32 on a CPU: inductor's CPU bf16 lowering fails")
    parser.add_argument("--pairs", type=int, default=2, help="cold-then-warm pairs, each over a new directory")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    add_json_option(parser, "the timings")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(warm_up_once(args.model, args.device, args.dtype)), flush=True)
        return
    runs: dict[str, list[dict]] = {"cold": [], "warm": []}
    for pair in range(args.pairs):
        with tempfile.TemporaryDirectory(prefix="tandem-compile-cache-") as cache_dir:
            for kind in ("cold", "warm"):
                runs[kind].append(child(Path(cache_dir), args))
                if wants_text(args):
                    print(f"pair {pair + 1}: {kind} warm-up {runs[kind][-1]['seconds']:.1f} s", flush=True)
    seconds = {kind: sum(r["seconds"] for r in rs) for kind, rs in runs.items()}
    report = {"model": args.model, "device": args.device, "dtype": args.dtype, "runs": runs,
              "cold_over_warm": seconds["cold"] / seconds["warm"]}
    if wants_text(args):
        print(f"cold / warm: {report['cold_over_warm']:.2f}x")
    write_json(args.json, report)


if __name__ == "__main__":
    main()
