"""core.cpu_attention's kernel against PyTorch's sdpa inside the compiled decode forward, one process: each model's
compiled runner (bf16, as `--compile` runs it), ROWS rows of 300 cached tokens each (a few tokens apart), a forward
of WIDTH tokens a row rolled back after each, so every forward sees the same context. The arms (the kernel on and
off, core.cpu_attention.ENABLED; each runs its own compiled graphs, warmed up first) alternate every round, STEPS
forwards each; per model, rows and width the median forward over the rounds and the ratio kernel/sdpa. MODELS:
name:quantization pairs, comma-separated.

    PYTHONPATH=services python docs/bench/cpu-attention-forward-v1.py ROUNDS OUT.json [MODELS]      # 6 min on CPU-A
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from tandem.bench.forward_split import cached_state
from tandem.core import cpu_attention
from tandem.core.runner import ModelRunner
from tandem.models.loader import load_model

STEPS, CONTEXT, SHAPES = 5, 300, ((1, 1), (8, 1), (8, 3))  # (rows, width)
ARMS = {"kernel": True, "sdpa": False}


def forward(runner: ModelRunner, states: list, width: int) -> None:
    keeps = [len(state.tokens) for state in states]
    for state, keep in zip(states, keeps, strict=True):
        state.sync(keep, [(11 * keep + j) % runner.vocab_size for j in range(width)])
    runner.forward_on_device(states, [1] * len(states))
    for state, keep in zip(states, keeps, strict=True):
        state.sync(keep, [])


def measure(name: str, quantization: str, rounds: int) -> list[dict]:
    model = load_model(name, device=torch.device("cpu"), dtype=torch.bfloat16, progress=False,
                       quantization=quantization).model
    runner = ModelRunner(model, compile=True)
    results = []
    with torch.inference_mode():
        states = [cached_state(runner, f"r{row}", CONTEXT - 3 * row, offset=row) for row in range(8)]
        for rows, width in SHAPES:
            times: dict[str, list[float]] = {arm: [] for arm in ARMS}
            for round_ in range(rounds + 1):
                for arm in list(ARMS)[:: 1 if round_ % 2 == 0 else -1]:
                    cpu_attention.ENABLED[0] = ARMS[arm]
                    forward(runner, states[:rows], width)  # its graph: compiled on the first round
                    started = time.perf_counter()
                    for _ in range(STEPS):
                        forward(runner, states[:rows], width)
                    if round_:
                        times[arm].append((time.perf_counter() - started) / STEPS)
            cpu_attention.ENABLED[0] = True
            ms = {arm: statistics.median(t) * 1e3 for arm, t in times.items()}
            result = {"model": name, "quantization": quantization, "rows": rows, "width": width,
                      "ms": {arm: round(m, 2) for arm, m in ms.items()},
                      "kernel_over_sdpa": round(ms["kernel"] / ms["sdpa"], 4),
                      "kernel_over_sdpa_each": [round(a / b, 4) for a, b in zip(times["kernel"], times["sdpa"],
                                                                                 strict=True)]}
            print(json.dumps(result), flush=True)
            results.append(result)
    assert runner.graphs.compiled, runner.graphs.compile_error
    return results


def main(rounds: int, out: str, models: str) -> None:
    torch.set_num_threads(2)
    assert cpu_attention.ready(), "the kernel does not run on this machine"
    report = {"rounds": rounds, "steps": STEPS, "context": CONTEXT, "threads": 2, "torch": torch.__version__,
              "results": [r for spec in models.split(",") for r in measure(*spec.split(":"), rounds)]}
    with open(out, "w") as sink:
        json.dump(report, sink, indent=1)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2],
         sys.argv[3] if len(sys.argv) > 3 else "qwen2.5-coder-1.5b-instruct:none,qwen2.5-coder-0.5b-instruct:w4")
