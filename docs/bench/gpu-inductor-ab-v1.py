"""Compiled decode forwards on a GPU under other inductor options or attention, on the real pair's shapes (random
weights), batch 1; one JSON out.

Variants (VARIANTS): cuBLAS products and sdpa attention (the runner's default); inductor's coordinate-descent tuning,
which also rewrites a product with one row (every projection of a batch-1 decode step) as a Triton reduction tuned
per shape, so the norm, activation and residual work around it can fuse into it (as gpt-fast compiles); and either
attending through core.flex_decode (core.attention.FLEX) or core.triton_decode (TRITON); and one-row products
through core.triton_gemv, the norms folded in (`rows`, core.fused_linear.ROW_PRODUCTS; not yet run on a GPU), with
the Triton attention over splits and merged (`rows_triton`) or over the whole buffer in one kernel (`rows_whole`),
and that with q/k/v's kernel writing the cache too (`rows_kv`, core.fused_linear.KV_WRITES).
Each variant is a runner compiled under its options (added to core.cuda_graphs.INDUCTOR_OPTIONS), all of them side
by side, and its logits for the same forward are set beside the first variant's (`logits_vs_first`: bf16 rounds
differently per kernel, so a few hundredths; a variant that computes something else shows as far more). Measured,
the variants interleaved, the
starting one alternating:
- one 1-token forward of the target at 256 cached tokens, logits on the device (median of `--reps`), per round;
- a profile of 20 such forwards: kernels launched and GPU kernel time per forward, the rest being gaps and host;
- plain decoding at batch 1 through the engine (tok/s end to end, `--rounds` runs of 2 prompts x `--tokens`), and a
  profile of it per token decoded (GPU kernel time against wall time, kernels launched);
  with `--decode-steps N`, each variant also decodes N tokens a verifier call (core.decode_steps), a row of its own;
- the draft's 1-token step, where there is time left (`--deadline-s`).

The H200 sitting of 2026-11-30 (docs/performance.md, "On a GPU") ran, each a fresh process:

    PYTHONPATH=services python3 docs/bench/gpu-inductor-ab-v1.py --deadline-s 290 --json gpu-inductor-ab-v1.json
    PYTHONPATH=services python3 docs/bench/gpu-inductor-ab-v1.py --variants cublas,cublas_flex --deadline-s 160 \
        --json gpu-flex-ab-v1.json
    PYTHONPATH=services python3 docs/bench/gpu-inductor-ab-v1.py --variants cublas_flex,cublas --rounds 8 \
        --deadline-s 140 --json gpu-flex-ab-v2.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "services"))

from tandem.bench.gpu_measures import kernel_share, prompts, timed
from tandem.bench.gpu_runs import HBM_BYTES_PER_S, build
from tandem.bench.row_products import best_tiles
from tandem.core import attention, cuda_graphs, fused_linear
from tandem.core.config import EngineConfig, SamplingParams
from tandem.core.engine import SpeculativeEngine
from tandem.core.fused_linear import stack_on_gpu
from tandem.core.local import LocalVerifier
from tandem.core.runner import ModelRunner

# name: (inductor options added, attention: sdpa, flex (core.flex_decode) or triton (core.triton_decode), whether
# one-row products run core.triton_gemv's kernel with the norms folded in (core.fused_linear.ROW_PRODUCTS), the
# Triton attention's keys per thread block (None: its SPLIT; 0: a row's keys in one block, in one kernel, unmerged),
# whether q/k/v's kernel writes the cache too (core.fused_linear.KV_WRITES))
VARIANTS = {
    "cublas": ({"coordinate_descent_tuning": False}, "sdpa", False, None, False),
    "cdt": ({"coordinate_descent_tuning": True}, "sdpa", False, None, False),
    "cdt_flex": ({"coordinate_descent_tuning": True}, "flex", False, None, False),
    "cublas_flex": ({"coordinate_descent_tuning": False}, "flex", False, None, False),
    "cublas_triton": ({"coordinate_descent_tuning": False}, "triton", False, None, False),
    "rows": ({"coordinate_descent_tuning": False}, "sdpa", True, None, False),
    "rows_triton": ({"coordinate_descent_tuning": False}, "triton", True, None, False),
    "rows_whole": ({"coordinate_descent_tuning": False}, "triton", True, 0, False),
    "rows_kv": ({"coordinate_descent_tuning": False}, "triton", True, 0, True),
}
CONTEXT = 256


class Variant:
    """One runner compiled under a variant's options; every call runs with its attention setting."""

    def __init__(self, name: str, model) -> None:
        self.name = name
        self.options, self.attention, self.rows, self.split, self.kv_writes = VARIANTS[name]
        saved = cuda_graphs.INDUCTOR_OPTIONS
        cuda_graphs.INDUCTOR_OPTIONS = saved | self.options  # read when the runner's forward is compiled
        try:
            self.runner = ModelRunner(model, compile=True)
        finally:
            cuda_graphs.INDUCTOR_OPTIONS = saved
        self.ids = prompts(1, seed=7, vocab=150000)[0] * 8
        self.prime()

    def prime(self) -> None:
        """The probe sequence, CONTEXT tokens cached, that forward() extends by one token."""
        self.state = self.runner.state("probe")
        self.state.sync(0, self.ids[:CONTEXT])
        self.call(lambda: self.runner.prefill(self.state, CONTEXT))

    def call(self, fn):
        saved = fused_linear.ROW_PRODUCTS[0], fused_linear.KV_WRITES[0]
        fused_linear.ROW_PRODUCTS[0], fused_linear.KV_WRITES[0] = self.rows, self.kv_writes
        try:
            with attention.gpu_attention(self.attention, split=self.split):
                return fn()
        finally:
            fused_linear.ROW_PRODUCTS[0], fused_linear.KV_WRITES[0] = saved

    def forward(self) -> torch.Tensor:
        """One 1-token forward at CONTEXT cached tokens, logits left on the device."""
        self.state.truncate_cache(CONTEXT)
        self.state.sync(CONTEXT, self.ids[CONTEXT : CONTEXT + 1])
        return self.call(lambda: self.runner.forward_on_device([self.state], [1]))

    def median_forward(self, reps: int) -> float:
        return sorted(timed(self.forward) for _ in range(reps))[reps // 2]

    def profile(self, forwards: int = 20) -> dict:
        share = kernel_share(lambda: [self.forward() for _ in range(forwards)], top=15)
        return {"wall_per_forward_s": share["wall_s"] / forwards,
                "kernel_s_per_forward": share["kernel_s"] / forwards,
                "launches_per_forward": share["launches"] / forwards,
                "top_kernels": [{"name": k["name"][:100], "launches_per_forward": k["launches"] / forwards,
                                 "us_per_forward": k["seconds"] * 1e6 / forwards} for k in share["top_kernels"]]}

    def plain_b1(self, work: list[list[int]], tokens: int, decode_steps: int = 1) -> dict:
        self.runner.release("probe")
        eng = SpeculativeEngine(LocalVerifier(self.runner), None, EngineConfig(max_batch=1, calibrate=False,
                                                                               decode_steps=decode_steps))
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        seconds = sum(timed(lambda p=p: self.call(lambda: eng.generate([p], params))) for p in work)
        self.prime()
        return {"tok_s": len(work) * tokens / seconds, "seconds": seconds}

    def profile_decode(self, prompt: list[int], tokens: int, decode_steps: int = 1) -> dict:
        """kernel_share of plain decoding one prompt, per token decoded (its prefill included, as end to end)."""
        share = kernel_share(lambda: self.plain_b1([prompt], tokens, decode_steps), top=15)
        return {"wall_per_token_s": share["wall_s"] / tokens, "kernel_s_per_token": share["kernel_s"] / tokens,
                "launches_per_token": share["launches"] / tokens,
                "top_kernels": [{"name": k["name"][:100], "launches_per_token": k["launches"] / tokens,
                                 "us_per_token": k["seconds"] * 1e6 / tokens} for k in share["top_kernels"]]}

    def status(self) -> dict:
        graphs = self.runner.graphs
        return {"compiled": graphs.compiled, "compile_error": graphs.compile_error, "captures": graphs.captures,
                "failed": sorted(graphs.failed)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="gpu-inductor-ab.json")
    parser.add_argument("--variants", default="cublas,cdt,cdt_flex")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--deadline-s", type=float, default=300.0, help="skip later stages past this")
    parser.add_argument("--decode-steps", type=int, default=1,
                        help="above 1: end to end, each variant also decodes this many tokens a verifier call "
                             "(core.decode_steps), as a row of its own named VARIANT_stepsN")
    parser.add_argument("--tiles", help="a tandem.bench.row_products report: its best tile per shape goes in "
                        "core.triton_gemv.TUNED before anything compiles (the `rows` variants' tiles)")
    args = parser.parse_args()
    started = time.perf_counter()
    device, dtype = torch.device("cuda"), torch.bfloat16
    name = torch.cuda.get_device_name()
    report: dict = {"device": name, "torch": torch.__version__, "dtype": "bfloat16", "context": CONTEXT,
                    "command": "PYTHONPATH=services python3 docs/bench/gpu-inductor-ab-v1.py " + " ".join(sys.argv[1:]),
                    "results": {}}
    res = report["results"]

    def log(key, value) -> None:
        res[key] = value
        report["wall_seconds"] = time.perf_counter() - started
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"[{time.perf_counter() - started:6.1f}s] {key}: {json.dumps(value)}", flush=True)

    def time_left() -> float:
        return args.deadline_s - (time.perf_counter() - started)

    if args.tiles and Path(args.tiles).exists():
        from tandem.core import triton_gemv

        triton_gemv.TUNED.update(best_tiles(args.tiles))
        report["tuned_tiles"] = {f"{n}x{k}": tile for (n, k), tile in triton_gemv.TUNED.items()}
    target = build("target", device, dtype)
    report["target_weight_bytes"] = weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
    report["stacked_linears"] = stack_on_gpu(target)
    hbm = next((v for key, v in HBM_BYTES_PER_S.items() if key in name), None)
    variants = {}
    for vname in args.variants.split(","):
        if variants and time_left() < 90:
            log(f"skipped_{vname}", "deadline")
            continue
        t0 = time.perf_counter()
        try:
            variant = Variant(vname, target)
            variant.median_forward(5)  # compiles and captures
        except Exception as exc:  # a variant that fails to build is reported, the others still run
            log(f"error_{vname}", f"{type(exc).__name__}: {exc}"[:800])
            continue
        variants[vname] = variant
        log(f"build_{vname}", {"seconds": time.perf_counter() - t0, **variant.status()})
    order = list(variants)
    if order:  # each variant's logits against the first's: a variant computing something else is no rival
        first = variants[order[0]].forward().float()
        log("logits_vs_first", {v: {"max_abs_diff": float((variants[v].forward().float() - first).abs().max()),
                                    "same_argmax": bool(variants[v].forward().argmax() == first.argmax()),
                                    "first_max_abs": float(first.abs().max())} for v in order[1:]})
    rounds: dict[str, list[float]] = {v: [] for v in order}
    for r in range(args.rounds):
        for vname in order if r % 2 == 0 else order[::-1]:
            rounds[vname].append(variants[vname].median_forward(args.reps))
    log("forward_s_rounds", rounds)
    medians = {v: sorted(xs)[len(xs) // 2] for v, xs in rounds.items()}
    log("forward_s", {v: {"median_of_rounds": s, "weight_bytes_s": weight_bytes / s,
                          "share_of_limit": weight_bytes / s / hbm if hbm else None} for v, s in medians.items()})
    for vname in order:
        log(f"profile_{vname}", variants[vname].profile())
    work = [p[:128] for p in prompts(4, seed=3)]
    # End to end: (row name, variant, decode_steps); a multi-step row decodes through its variant's runner.
    rows = [(v, v, 1) for v in order] + ([(f"{v}_steps{args.decode_steps}", v, args.decode_steps) for v in order]
                                         if args.decode_steps > 1 else [])
    if time_left() > 30:
        for _, vname, steps in rows:  # the engine's own shapes (prefill widths) compile here, not in a timed run
            variants[vname].plain_b1(work[:1], 8, steps)
        runs: dict[str, list[dict]] = {row: [] for row, _, _ in rows}
        for r in range(args.rounds):
            for row, vname, steps in rows if r % 2 == 0 else rows[::-1]:
                runs[row].append(variants[vname].plain_b1(work[2 * (r % 2) : 2 * (r % 2) + 2], args.tokens, steps))
        pooled = {v: 2 * args.rounds * args.tokens / sum(x["seconds"] for x in xs) for v, xs in runs.items()}
        log("plain_b1_end_to_end", {v: {"tok_s": t, "share_of_limit": weight_bytes * t / hbm if hbm else None,
                                         "runs": runs[v]} for v, t in pooled.items()})
        for row, vname, steps in rows:  # per decoded token: what of the wall time is GPU kernels, and how many run
            if time_left() > 20:  # outside the forward's graph (the head, the choice, the engine's own)
                log(f"profile_decode_{row}", variants[vname].profile_decode(work[0], args.tokens, steps))
    if time_left() > 120:
        draft = build("draft", device, dtype)
        stack_on_gpu(draft)
        costs: dict[str, list[float]] = {}
        drafts = {}
        for vname in ("cublas", "cdt", "rows"):
            if vname in variants and time_left() > 60:
                drafts[vname] = Variant(vname, draft)
        for r in range(args.rounds):
            for vname in list(drafts) if r % 2 == 0 else list(drafts)[::-1]:
                costs.setdefault(vname, []).append(drafts[vname].median_forward(args.reps))
        log("draft_step_s_rounds", costs)
    report["wall_seconds"] = time.perf_counter() - started
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}", flush=True)


if __name__ == "__main__":
    main()
