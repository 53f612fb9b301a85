"""GPU probe: tandem's runner on a GPU next to Hugging Face generate on the same weights; one JSON out.

Needs only torch and transformers, and tandem's own code from a checkout, installed or not: the real pair's configs
(Qwen2.5-Coder-1.5B-Instruct target, -0.5B draft) with random weights, random prompt ids, greedy, EOS ignored.
Random weights mean the draft agrees with the target about as often as chance, so the speculative runs show what
rounds cost, not what they gain; the gain at the real pair's acceptance is projected from measured forward costs
(tokens per round (1 - a^(k+1)) / (1 - a) over k draft steps plus one (k+1)-token verify) and labelled so.

Measures: tandem's three forward modes against each other in adjacent A B B A pairs (compiled: torch.compile's
kernels in CUDA graphs, the default; graphs: the eager kernels in CUDA graphs; eager: no graphs), plain and
speculative tok/s at batch 1 and 8 (tandem), HF generate plain (eager and, unless --no-compile, static cache +
torch.compile) and assisted at batch 1, the share of wall time spent in GPU kernels,
bytes allocated per decode step against the live KV cache (a cache copied every step allocates its whole size
again), and the plain batch-1 decode against the weight-bandwidth limit.

    python -m tandem.bench.gpu_probe --json probe.json                # under 10 minutes on one H100
    python -m tandem.bench.gpu_probe --only-modes --json modes.json   # the mode pairs and forward costs alone
    python -m tandem.bench.gpu_probe --only-costs --json costs.json   # one forward's cost, a few minutes
    python services/tandem/bench/gpu_probe.py --json probe.json       # the same from a checkout, tandem not installed
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

HERE = Path(__file__).resolve().parent
if not __package__ and sys.path and Path(sys.path[0] or ".").resolve() == HERE:
    # Run by path: the checkout's services/ in place of this folder, so tandem imports without an install and this
    # folder's modules (core, prompts, ...) shadow nothing.
    sys.path[0] = str(HERE.parents[1])

from torch.nn.attention import SDPBackend  # noqa: E402

from tandem.bench.gpu_measures import (  # noqa: E402
    FLEX,
    TRITON,
    allocated_per_step,
    attention_costs,
    forward_costs,
    kernel_share,
    projected_speedups,
    prompts,
    timed,
)
from tandem.core import attention  # noqa: E402
from tandem.core.config import EngineConfig, SamplingParams, SpecConfig  # noqa: E402
from tandem.core.engine import SpeculativeEngine  # noqa: E402
from tandem.core.fused_linear import stack_on_gpu  # noqa: E402
from tandem.core.local import LocalDrafter, LocalVerifier  # noqa: E402
from tandem.core.runner import ModelRunner  # noqa: E402

STDOUT = "-"  # `--json` alone: the report on stdout (tandem.cli.options.STDOUT)

COMMON = dict(vocab_size=151936, max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
              tie_word_embeddings=True, hidden_act="silu", eos_token_id=None, pad_token_id=0)
CONFIGS = {  # the published Qwen2.5-Coder-*-Instruct config.json shapes
    "target": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                   num_key_value_heads=2),
    "draft": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2),
}
HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}  # datasheet peaks (SXM)
CASES = {"plain_b1": (None, 1, 4), "spec_k4_b1": (4, 1, 2), "plain_b8": (None, 8, 8)}  # k, batch, prompts
MODES = {"compiled": dict(graphs=True, compile=True), "graphs": dict(graphs=True, compile=False),
         "eager": dict(graphs=False, compile=False)}


def build(role: str, device: torch.device, dtype: torch.dtype, **shape) -> Qwen2ForCausalLM:
    """The real pair's shapes with random weights; `shape` overrides fields (tests shrink the model)."""
    config = Qwen2Config(**(COMMON | CONFIGS[role] | shape))
    torch.manual_seed({"target": 1, "draft": 2}[role])
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def engine(target, draft, k: int | None, batch: int, mode: str = "compiled") -> SpeculativeEngine:
    """k None: plain; k 0: adaptive (AUTO, calibrated); k > 0: fixed k. `mode`: a key of MODES."""
    verifier = LocalVerifier(ModelRunner(target, cuda_graphs=MODES[mode]["graphs"], compile=MODES[mode]["compile"]))
    if k is None:
        return SpeculativeEngine(verifier, None, EngineConfig(max_batch=batch, calibrate=False))
    spec = SpecConfig(k_max=8 if k == 0 else k, k_init=4 if k == 0 else k, adaptive=k == 0)
    drafter = LocalDrafter(ModelRunner(draft, cuda_graphs=MODES[mode]["graphs"], compile=MODES[mode]["compile"]),
                           top_m=spec.draft_top_m,
                           confidence=spec.stop_confidence)
    return SpeculativeEngine(verifier, drafter, EngineConfig(spec=spec, max_batch=batch, calibrate=k == 0))


def run_tandem(target, draft, k, batch: int, work: list[list[int]], tokens: int, mode: str = "compiled") -> dict:
    eng = engine(target, draft, k, batch, mode)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    eng.generate([work[0][:32]], params)  # warm-up
    results = []
    seconds = 0.0
    for start in range(0, len(work), batch):
        group = work[start : start + batch]
        seconds += timed(lambda group=group: results.extend(eng.generate(group, params)))
    drafted = sum(r.stats.get("drafted", 0) for r in results)
    accepted = sum(r.stats.get("accepted", 0) for r in results)
    out = sum(len(r.token_ids) for r in results)
    graphs = [g for g in (eng.verifier.runner.graphs, eng.drafter and eng.drafter.runner.graphs) if g]
    return {"tok_s": out / seconds, "tokens": out, "seconds": seconds, "drafted": drafted, "accepted": accepted,
            "graph_captures": sum(g.captures for g in graphs), "graph_failures": sum(len(g.failed) for g in graphs),
            "compiled": [g.compiled for g in graphs], "compile_errors": [g.compile_error for g in graphs
                                                                         if g.compile_error]}


def hf_generate(model, work: list[list[int]], batch: int, tokens: int, assistant=None, **kwargs) -> dict:
    device = next(model.parameters()).device
    out = 0
    seconds = 0.0
    for start in range(0, len(work), batch):
        group = work[start : start + batch]
        width = max(map(len, group))
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(group):  # left padding, as generate expects for decoder-only models
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        ids, mask = ids.to(device), mask.to(device)

        def call(ids=ids, mask=mask):
            return model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                                  do_sample=False, assistant_model=assistant, **kwargs)

        seconds += timed(call)
        out += len(group) * tokens
    return {"tok_s": out / seconds, "tokens": out, "seconds": seconds}


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


def forward_costs_only(target, draft, log, context: int = 256, compile: bool = True) -> None:
    """One compiled forward's cost (a draft step, the target at 1 and 5 tokens, `context` cached) and the speculative
    speedup at batch 1 those costs project at the acceptance rates of projected_speedups: a few minutes where the
    whole probe takes ten."""
    draft_step = forward_costs(ModelRunner(draft, compile=compile), [1], context=context)[1]
    target_costs = forward_costs(ModelRunner(target, compile=compile), [1, 5], context=context)
    log("forward_seconds", {"target": target_costs, "draft_step": draft_step})
    log("projected_spec_b1_from_forward_costs", projected_speedups(target_costs, draft_step))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--json", nargs="?", const=STDOUT, default="gpu-probe.json", metavar="PATH",
                        help="the report: on stdout when PATH is left out, else PATH, rewritten after each figure")
    parser.add_argument("--tokens", type=int, default=128, help="tokens generated per request")
    parser.add_argument("--num-prompts", type=int, default=8, help="random prompts (64 to 256 tokens)")
    parser.add_argument("--warm-seconds", type=float, default=45.0, help="decode this long before measuring")
    parser.add_argument("--no-compile", action="store_true", help="skip HF generate with static cache + compile")
    parser.add_argument("--only-modes", action="store_true",
                        help="only tandem's forward modes against each other, their forward costs and kernel shares")
    parser.add_argument("--only-stacking", action="store_true",
                        help="only the target with stacked sibling projections against it unstacked, plain decoding")
    parser.add_argument("--only-attention", choices=[n for n in ATTENTION_BACKENDS if n != "default"],
                        help="only one attention call per sdpa kernel set, then decoding with PyTorch's pick against "
                             "this one (the stacked target, plain)")
    parser.add_argument("--only-costs", action="store_true",
                        help="only one compiled forward's cost (a draft step; the target at 1 and 5 tokens) and the "
                             "speculative speedup they project")
    parser.add_argument("--pairs", type=int, default=1, help="with --only-stacking or --only-attention: A B B A pairs "
                                                             "per case")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit(f"gpu_probe: CUDA is not available (torch {torch.__version__})")
    device, dtype = torch.device("cuda"), torch.bfloat16
    started = time.perf_counter()
    target, draft = build("target", device, dtype), build("draft", device, dtype)
    name = torch.cuda.get_device_name()
    weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
    work = prompts(args.num_prompts)
    batch1 = work[:4]
    report: dict = {"device": name, "torch": torch.__version__, "dtype": "bfloat16", "tokens": args.tokens,
                    "prompt_lengths": list(map(len, work)), "target_weight_bytes": weight_bytes, "results": {}}
    res = report["results"]
    progress = sys.stderr if args.json == STDOUT else sys.stdout

    def save(final: bool = False) -> None:
        if args.json != STDOUT:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        if final:
            print(json.dumps(report) if args.json == STDOUT else f"wrote {args.json}", flush=True)

    def log(key, value):
        res[key] = value
        save()  # a run cut short still leaves its figures
        print(f"[{time.perf_counter() - started:6.1f}s] {key}: {json.dumps(value)}", file=progress, flush=True)

    def bandwidth(tok_s: float) -> dict:
        hbm = next((v for key, v in HBM_BYTES_PER_S.items() if key in name), None)
        return {"hbm_peak_bytes_s": hbm, "plain_b1_tok_s": tok_s, "weight_bytes_s": weight_bytes * tok_s,
                "limit_tok_s": hbm / weight_bytes if hbm else None,
                "share_of_limit": weight_bytes * tok_s / hbm if hbm else None}

    def finish(plain_b1_tok_s: float | None = None) -> None:
        if plain_b1_tok_s is not None:
            report["bandwidth"] = bandwidth(plain_b1_tok_s)
        report["wall_seconds"] = time.perf_counter() - started
        save(final=True)

    if args.only_stacking:
        stacking_ab(target, work, args.tokens, args.warm_seconds, log, args.pairs)
        return finish(res["stacked_vs_unstacked_plain_b1"]["stacked_tok_s"])
    report["stacked_linears"] = stack_on_gpu(target) + stack_on_gpu(draft)  # as the loader prepares them
    if args.only_costs:
        forward_costs_only(target, draft, log)
        return finish()
    if args.only_attention:
        attention_ab(target, work, args.tokens, args.warm_seconds, log, args.pairs, args.only_attention)
        return finish(res[f"default_vs_{args.only_attention}_plain_b1"]["default_tok_s"])
    # First calls of each new shape pay one-off kernel selection and compiles (timed here): warm every prompt's
    # prefill, and the decode shapes of plain and speculative rounds at batch 1 and 8. Then keep decoding for a
    # while: on the lent H100 the same run doubled its tok/s over its first minute (clocks ramping;
    # docs/bench/gpu-order-check-v1.json), so figures taken cold are not comparable with later ones.
    for k, batch in ((None, 1), (4, 1), (None, 8)) + (() if args.only_modes else ((4, 8),)):
        log(f"warm_up_seconds_k{k}_b{batch}", timed(lambda k=k, batch=batch: run_tandem(
            target, draft, k, batch, work if k is None else work[:batch], 2 if k is None else 8)))
    warm_until = time.perf_counter() + args.warm_seconds
    while time.perf_counter() < warm_until:
        run_tandem(target, draft, None, 8, work, 32)
    mode_pairs(target, draft, work, args.tokens, log, "compiled", "graphs")
    costs = {}
    for mode in ("compiled", "graphs"):
        runners = [ModelRunner(model, compile=MODES[mode]["compile"]) for model in (target, draft)]
        costs[mode] = {"target": forward_costs(runners[0], [1, 2, 3, 5, 9], context=256),
                       "draft_step": forward_costs(runners[1], [1], context=256)[1]}
    log("forward_seconds", costs)
    log("projected_spec_b1_from_forward_costs", projected_speedups(costs["compiled"]["target"],
                                                                    costs["compiled"]["draft_step"]))
    params32 = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for mode in ("compiled", "graphs"):
        plain_b1 = engine(target, None, None, 1, mode)
        log(f"kernel_share_{mode}_plain_b1", kernel_share(lambda eng=plain_b1: eng.generate([work[1]], params32)))
    report["bandwidth"] = bandwidth(res["compiled_vs_graphs_plain_b1"]["compiled_tok_s"])
    print("bandwidth:", json.dumps(report["bandwidth"]), file=progress, flush=True)
    if args.only_modes:
        from torch._dynamo.utils import counters

        report["dynamo_stats"] = dict(counters["stats"])  # unique_graphs: how many compiles in all
        return finish()
    hf_generate(target, work, 1, 2)
    mode_pairs(target, draft, work, args.tokens, log, "graphs", "eager")
    # Plain decoding of both stacks at batch 1 in the order A B B A, each pair pooled.
    pairs = {"tandem_plain_b1": [], "hf_plain_b1": []}
    for key in ("tandem_plain_b1", "hf_plain_b1", "hf_plain_b1", "tandem_plain_b1"):
        half = batch1[:2] if len(pairs[key]) == 0 else batch1[2:]
        pairs[key].append(run_tandem(target, draft, None, 1, half, args.tokens) if key.startswith("tandem")
                          else hf_generate(target, half, 1, args.tokens))
    for key, runs in pairs.items():
        tokens, seconds = sum(r["tokens"] for r in runs), sum(r["seconds"] for r in runs)
        log(key, {"tok_s": tokens / seconds, "tokens": tokens, "seconds": seconds,
                  "each_tok_s": [r["tok_s"] for r in runs]})
    for key, k, batch, items in (("tandem_spec_k4_b1", 4, 1, batch1[:2]), ("tandem_auto_b1", 0, 1, batch1),
                                 ("tandem_plain_b8", None, 8, work), ("tandem_spec_k4_b8", 4, 8, work)):
        log(key, run_tandem(target, draft, k, batch, items, args.tokens))
    log("hf_plain_b8", hf_generate(target, work, 8, args.tokens))
    log("hf_assisted_b1", hf_generate(target, batch1[:2], 1, args.tokens, assistant=draft))
    log("kernel_share_hf_plain_b1", kernel_share(lambda: hf_generate(target, [work[1]], 1, 32)))
    log("alloc_tandem_plain_b1", allocated_per_step(lambda: engine(target, None, None, 1), work[:1], (256, 1024)))
    log("alloc_tandem_plain_b8", allocated_per_step(lambda: engine(target, None, None, 8), work, (256, 1024)))
    report["bandwidth"] = bandwidth(res["tandem_plain_b1"]["tok_s"])
    print("bandwidth:", json.dumps(report["bandwidth"]), file=progress, flush=True)
    if not args.no_compile:
        try:
            kwargs = dict(cache_implementation="static")
            hf_generate(target, batch1, 1, args.tokens, **kwargs)  # compiles every prompt's shapes
            log("hf_static_compiled_b1", hf_generate(target, batch1, 1, args.tokens, **kwargs))
        except Exception as exc:  # report, do not lose the rest of the probe
            log("hf_static_compiled_b1", {"error": f"{type(exc).__name__}: {exc}"[:500]})
    finish()


if __name__ == "__main__":
    main()
