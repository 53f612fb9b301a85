"""How tandem.bench.vllm_compare starts its two resident workers: the command each runs, the environment each gets
(LD_PRELOAD as vLLM's CPU guide asks, vLLM's threads bound and its KV cache space), the Hugging Face directories and
chat-templated prompts vLLM's side loads; and `say`, the sitting's progress line, which the workers' echo threads
write too.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from tandem.bench.resident import Resident
from tandem.core.cpu_runtime import suggested_preload

TANDEM_SIDE = [sys.executable, "-m", "tandem.bench.vllm_compare_tandem"]
VLLM_SIDE = Path(__file__).resolve().with_name("vllm_compare_vllm.py")  # run by path with vLLM's own Python
STARTED = time.perf_counter()


def say(message: str) -> None:
    """Progress, on stderr: stdout is left to the report when --json asks for it there. The workers' echo threads
    call it too, hence one write per line."""
    sys.stderr.write(f"[{time.perf_counter() - STARTED:7.1f}s] {message}\n")
    sys.stderr.flush()


def preload(args: argparse.Namespace) -> str:
    """LD_PRELOAD as vLLM's CPU guide asks: tcmalloc and Intel's OpenMP runtime (vLLM's venv's libiomp5, which PyPI's
    intel-openmp installs), those of them present."""
    return suggested_preload(Path(args.vllm_python).parent.parent / "lib" / "libiomp5.so")


def vllm_env(args: argparse.Namespace) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}", "VLLM_CPU_KVCACHE_SPACE": str(args.kv_space),
            "LD_PRELOAD": preload(args)}
    return env


def tandem_env(args: argparse.Namespace) -> dict[str, str]:
    """tandem's workers run with the same preload as vLLM's (docs/performance.md, "Intel's OpenMP runtime"), unless
    --tandem-no-preload leaves them on torch's own libgomp and glibc's malloc."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    return env if args.tandem_no_preload else env | {"LD_PRELOAD": preload(args)}


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


def tandem_worker(args: argparse.Namespace, jobs: list[str], log: Path) -> Resident:
    """tandem's resident worker: the pair loaded once, a plain and an AUTO engine (tandem.bench.vllm_compare_tandem)."""
    return Resident("tandem", TANDEM_SIDE, {
        "target": args.target, "draft": args.draft, "texts": jobs, "max_tokens": args.max_tokens,
        "threads": args.threads, "dtype": args.dtype, "compile": args.compile,
        "draft_quantization": args.draft_quantization, "draft_vocab": args.draft_vocab}, log, tandem_env(args),
        echo=("tandem ", "vllm "), say=say)


def vllm_job(args: argparse.Namespace, jobs: list[str]) -> dict:
    """What vLLM's side loads and sends: Hugging Face directories, and the prompts chat-templated as tandem does."""
    from transformers import AutoTokenizer, GenerationConfig

    from tandem.engines.local import encode_prompt
    from tandem.models.loader import eos_token_ids

    target_dir, draft_dir = hf_dir(args.target), hf_dir(args.draft)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    generation = SimpleNamespace(generation_config=GenerationConfig.from_pretrained(target_dir))
    return {"target_dir": target_dir, "draft_dir": draft_dir, "k": args.k, "max_tokens": args.max_tokens,
            "max_model_len": args.max_model_len, "dtype": args.dtype,
            "eos_ids": sorted(eos_token_ids(generation, tokenizer)),  # the ids tandem stops at
            "jobs": [encode_prompt(tokenizer, t, chat=True) for t in jobs]}
