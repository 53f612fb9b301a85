"""The GPU probe's A/B comparisons (tandem.bench.gpu_probe): two sides run against each other in adjacent A B B A
pairs per case (side_pairs, plain_pairs), over tandem's forward modes (mode_pairs), stacked against unstacked
projections (stacking_ab), and PyTorch's attention pick against one sdpa kernel set, flex or Triton (attention_ab).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from functools import partial

from torch.nn.attention import SDPBackend

from tandem.bench.gpu_measures import FLEX, TRITON, attention_costs, forward_costs, kernel_share
from tandem.bench.gpu_runs import engine, run_tandem
from tandem.core import attention
from tandem.core.config import SamplingParams
from tandem.core.fused_linear import stack_on_gpu
from tandem.core.runner import ModelRunner

CASES = {"plain_b1": (None, 1, 4), "spec_k4_b1": (4, 1, 2), "plain_b8": (None, 8, 8)}  # k, batch, prompts


def mode_pairs(target, draft, work: list[list[int]], tokens: int, log, a: str, b: str) -> None:
    """tandem in mode `a` against mode `b` (keys of MODES): plain and k 4 at batch 1, plain at batch 8."""
    sides = {mode: partial(run_tandem, target, draft, mode=mode) for mode in (a, b)}
    side_pairs(sides, work, tokens, log)


def side_pairs(sides: dict[str, Callable[..., dict]], work: list[list[int]], tokens: int, log,
               cases: tuple[str, ...] = ("plain_b1", "spec_k4_b1", "plain_b8"), suffix: str = "") -> None:
    """Two sides, each `run(k, batch, items, tokens) -> run_tandem's dict`, against each other per case in the order
    A B B A (at batch 1 each run takes half the prompts), each side's two runs pooled; logged as
    `{a}_vs_{b}_{case}{suffix}`."""
    a, b = sides
    for case in cases:
        k, batch, items = CASES[case]
        items = work[:items]
        runs: dict[str, list[dict]] = {a: [], b: []}
        for side in (a, b, b, a):
            half = items if batch > 1 else (items[: len(items) // 2] if not runs[side] else items[len(items) // 2:])
            runs[side].append(sides[side](k, batch, half, tokens))
        pooled = {side: sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs) for side, rs in runs.items()}
        errors = [e for r in runs[a] + runs[b] for e in r["compile_errors"]]
        log(f"{a}_vs_{b}_{case}{suffix}", {f"{a}_tok_s": pooled[a], f"{b}_tok_s": pooled[b],
                                           "speedup": pooled[a] / pooled[b], "compile_errors": errors})


def plain_pairs(sides: list[tuple[str, Callable[..., dict]]], work: list[list[int]], tokens: int,
                warm_seconds: float, log, pairs: int = 1) -> None:
    """Two sides, each `run(k, batch, items, tokens)` (run_tandem with its model bound), decoding plainly at batch 1
    and 8: each side's shapes compiled, `warm_seconds` of decoding, then `pairs` A B B A pairs per case (side_pairs),
    the side that starts alternating."""
    for _, side in sides:
        for batch in (1, 8):
            side(None, batch, work[:batch], 2)  # compiles this batch's shapes
    warm_until = time.perf_counter() + warm_seconds
    while time.perf_counter() < warm_until:
        for _, side in sides:
            side(None, 8, work, 16)
    for pair in range(pairs):
        side_pairs(dict(sides[::-1] if pair % 2 else sides), work, tokens, log, cases=("plain_b1", "plain_b8"),
                   suffix=f"_pair{pair + 1}" if pair else "")


ATTENTION_BACKENDS = {"default": None, "efficient": (SDPBackend.EFFICIENT_ATTENTION,),
                      "cudnn": (SDPBackend.CUDNN_ATTENTION,), "math": (SDPBackend.MATH,), "flex": FLEX,
                      "triton": TRITON}


def run_with_backends(backends: tuple | str | None, *args, **kwargs) -> dict:
    """run_tandem with the runner's attention restricted to `backends` (core.attention.BACKENDS), or attending
    through core.flex_decode (FLEX) or core.triton_decode (TRITON); the other settings off whatever the environment
    set (TANDEM_GPU_ATTENTION), and all restored after."""
    kernel = backends if backends in (FLEX, TRITON) else "sdpa"
    with attention.gpu_attention(kernel, backends if kernel == "sdpa" else None):
        return run_tandem(*args, **kwargs)


def attention_ab(target, work: list[list[int]], tokens: int, warm_seconds: float, log, pairs: int = 1,
                 against: str = "efficient") -> None:
    """One attention call per sdpa kernel set (ATTENTION_BACKENDS) at the runner's shapes, then the target decoding
    with PyTorch's pick against `against`, compiled graphs, plain at batch 1 and 8 (`pairs` A B B A pairs)."""
    log("attention_seconds", attention_costs(target.device, ATTENTION_BACKENDS))
    sides = [(name, partial(run_with_backends, ATTENTION_BACKENDS[name], target, None))
             for name in ("default", against)]
    plain_pairs(sides, work, tokens, warm_seconds, log, pairs)


def stacking_ab(target, work: list[list[int]], tokens: int, warm_seconds: float, log, pairs: int = 1) -> None:
    """The target with its sibling projections stacked (core.fused_linear, what the loader does on a GPU, which
    also folds the layers: core.folded_layers) against the same weights unstacked, compiled graphs, plain decoding
    at batch 1 and 8 (`pairs` A B B A pairs per case, the side that starts alternating): tok/s, one forward's cost,
    and where the kernel time goes."""
    unstacked = copy.deepcopy(target)
    log("stacked_linears", stack_on_gpu(target))
    variants = {"stacked": target, "unstacked": unstacked}
    plain_pairs([(name, partial(run_tandem, model, None)) for name, model in variants.items()], work, tokens,
                warm_seconds, log, pairs)
    params32 = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for name, model in variants.items():
        plain_b1 = engine(model, None, None, 1)
        log(f"kernel_share_{name}_plain_b1", kernel_share(lambda eng=plain_b1: eng.generate([work[1]], params32)))
    for name, model in variants.items():
        log(f"forward_seconds_{name}", forward_costs(ModelRunner(model, compile=True), [1], context=256))

