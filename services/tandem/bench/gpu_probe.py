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

The models and timed runs are gpu_runs.py's, the A B B A comparisons gpu_ab.py's, the other measures gpu_measures.py's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
if not __package__ and sys.path and Path(sys.path[0] or ".").resolve() == HERE:
    # Run by path: the checkout's services/ in place of this folder, so tandem imports without an install and this
    # folder's modules (core, prompts, ...) shadow nothing.
    sys.path[0] = str(HERE.parents[1])

from tandem.bench.gpu_ab import ATTENTION_BACKENDS, attention_ab, mode_pairs, stacking_ab  # noqa: E402
from tandem.bench.gpu_measures import (  # noqa: E402
    allocated_per_step,
    forward_costs,
    kernel_share,
    projected_speedups,
    prompts,
    timed,
)
from tandem.bench.gpu_runs import HBM_BYTES_PER_S, MODES, build, engine, hf_generate, run_tandem  # noqa: E402
from tandem.core.config import SamplingParams  # noqa: E402
from tandem.core.fused_linear import stack_on_gpu  # noqa: E402
from tandem.core.runner import ModelRunner  # noqa: E402

STDOUT = "-"  # `--json` alone: the report on stdout (tandem.cli.options.STDOUT)


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
