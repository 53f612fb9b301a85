"""The model flags shared by the commands that load models (`tandem generate`, `serve`, `pools start`, `bench` and the
benchmarks): which target and draft, where and how they run, the engine settings the flags give, and loading the pair.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import TYPE_CHECKING

from tandem.cli.options import field_as_option
from tandem.core.config import EngineConfig, SpecConfig
from tandem.core.model_options import (
    DEFAULT_DRAFT_QUANTIZATION,
    DEFAULT_RETAIN_TOKENS,
    QUANTIZATIONS,
    check_retain_tokens,
    compile_scope,
    compiles,
)
from tandem.errors import InvalidArgument

if TYPE_CHECKING:  # torch is imported where models load: `tandem generate --address` runs on the client install
    import torch

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


def add_model_options(parser: argparse.ArgumentParser, cache_reuse: bool = True) -> None:
    """`cache_reuse`: offer --retain-tokens and --no-prefix-cache (a benchmark that times whole prompts has neither:
    its arguments read as prefix caching off)."""
    parser.add_argument("--target", default=DEFAULT_TARGET,
                        help="registry name, HF directory, GGUF file or hub id (default: %(default)s)")
    parser.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model, same forms (default: %(default)s)")
    parser.add_argument("--allow-unpinned", action="store_true",
                        help="accept a hub id without a commit (org/name rather than org/name@<40-hex commit>): it "
                             "is resolved to the commit the hub serves now, once at start, and logged")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    parser.add_argument("--dtype", default="auto", help="auto, bfloat16, float16 or float32 (default: auto)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch in each process that runs a model (default: all cores; a Ray "
                             "worker of `tandem pools start` or of a cluster joined with --ray-address: the CPUs Ray "
                             "gives it, one)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--eager", action="store_true",
                      help="run the models as Hugging Face builds them, without the device's fast path "
                           "(on CPU: oneDNN linears with prepacked weights; on a GPU: torch.compile'd CUDA graphs)")
    mode.add_argument("--compile", action="store_const", const="all", default="none",
                      help="on a CPU, compile the decode forwards with torch.compile as a GPU does by default: "
                           "decoding 4-7%% faster, after minutes of compiling at start (kept in the compile cache "
                           "for the next start)")
    mode.add_argument("--compile-draft", dest="compile", action="store_const", const="draft",
                      help="on a CPU, compile the draft's decode forwards alone: its small layers gain most from "
                           "compiling (speculative decoding at batch 1 1.06-1.11x), after minutes of compiling at "
                           "start")
    parser.add_argument("--k-max", type=int, default=SpecConfig().k_max, help="most draft tokens per round")
    parser.add_argument("--fixed-k", type=int, default=None, help="draft exactly this many tokens (no adaptation)")
    parser.add_argument("--decode-steps", type=int, default=EngineConfig().decode_steps, metavar="N",
                        help="when no row of a step drafts, decode up to N tokens a row in one call to the target, "
                             "each fed to the next forward on its device: no host round trip per token, tokens "
                             "stream in blocks of N (default: %(default)s)")
    parser.add_argument("--draft-confidence", type=float, default=SpecConfig().draft_confidence,
                        help="stop drafting once the draft's top probability falls below this (0: never)")
    parser.add_argument("--prompt-lookup", action="store_true",
                        help="draft for free from each request's own context where its output repeats it (prompt "
                             "lookup: code edited or explained, text quoted), in the rounds where that beats the "
                             "draft model's drafts; with --no-spec, the target's only drafts. Output stays exact")
    parser.add_argument("--draft-vocab", type=int, default=SpecConfig().draft_vocab,
                        help="draft scores only the first N token ids (0: all); output stays exact, but text whose "
                             "tokens lie above N is drafted worse (Qwen's, 65536: English code 1.06x faster, "
                             "Chinese 0.76x; docs/performance.md)")
    parser.add_argument("--draft-quantization", choices=QUANTIZATIONS, default=DEFAULT_DRAFT_QUANTIZATION,
                        help="hold the draft's weights as int8 (one scale per output row): a draft step reads half "
                             "the bytes; output stays exact, acceptance may drop slightly. int8 keeps the activations "
                             "in the model's dtype; w8a8 quantizes them too, per row, for oneDNN's int8 GEMM, the "
                             "fast one on an AVX-512 or AMX CPU; w4 adds an int4 copy (a scale and zero point per "
                             "group of 128 inputs) that one-row draft steps read, a quarter of the bf16 bytes; auto "
                             "is w4 for a bf16 draft on an AVX-512 CPU (its draft steps half the time, about 8 s "
                             "more to load), none elsewhere (default: %(default)s)")
    parser.add_argument("--kv-tokens", type=int, default=0, metavar="N",
                        help="KV cache budget of each model (the target's and the draft's, in every worker), in "
                             "tokens counted as sequences x the longest one's length (default 0: a share of the "
                             "memory free at start: the GPU's, or the host's available memory)")
    if not cache_reuse:
        parser.set_defaults(retain_tokens=DEFAULT_RETAIN_TOKENS, prefix_cache=False)
        return
    parser.add_argument("--retain-tokens", type=int, default=DEFAULT_RETAIN_TOKENS, metavar="N",
                        help="KV cache tokens finished requests' keys and values may hold in each model, within "
                             "--kv-tokens, for a session's next turn and for prefixes later requests share (each "
                             "kept request holds a slot as long as the longest sequence held); the least recently "
                             "used go first, and any of them when a running request needs the room (default "
                             f"{DEFAULT_RETAIN_TOKENS}; 0: none kept)")
    parser.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                        help="compute every prompt whole: by default a new request copies the keys and values of the "
                             "longest prefix of its prompt that a running or recently finished request of the same "
                             "tenant has cached (a shared system prompt, tools, few-shot examples) instead of "
                             "computing them; benchmarks that repeat prompts turn it off")


def add_bench_model_options(parser: argparse.ArgumentParser, dtype: str,
                            dtype_help: str = "both models' dtype") -> None:
    """--target, --draft, --dtype and --threads of a benchmark that loads the pair in its own process (2 threads by
    default: the machines the documented figures come from)."""
    parser.add_argument("--target", default=DEFAULT_TARGET, help="target model")
    parser.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model")
    parser.add_argument("--dtype", default=dtype, help=dtype_help)
    parser.add_argument("--threads", type=int, default=2, help="torch's CPU threads")


def local_options(args: argparse.Namespace):
    """How the model options place models in this process (engines.LocalOptions)."""
    from tandem.engines.options import LocalOptions

    return LocalOptions(device=args.device, dtype=args.dtype, threads=args.threads, eager=args.eager,
                        compile=args.compile, kv_tokens=args.kv_tokens, draft_quantization=args.draft_quantization,
                        retain_tokens=args.retain_tokens, prefix_cache=args.prefix_cache)


def add_calibration_file_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--calibration-file", default=None, metavar="PATH",
                        help="keep the costs calibration measures in PATH: a restart with the same models, options, "
                        "host and tandem reuses them instead of calibrating (minutes on a CPU); otherwise it "
                        "calibrates and stores them there ('': calibrate at every start; default: "
                        "$TANDEM_CALIBRATION_FILE, else calibration.json under $TANDEM_HOME)")


def calibration_file(args: argparse.Namespace) -> str:
    """--calibration-file, or its default (models.store.default_calibration_file); '' for none. Not a directory."""
    from tandem.models.store import default_calibration_file

    path = default_calibration_file() if args.calibration_file is None else args.calibration_file
    if path and os.path.isdir(path):
        raise InvalidArgument(f"calibration_file: {path} is a directory; name a file in it")
    return path


def engine_config(args: argparse.Namespace, speculate: bool = True, max_batch: int | None = None) -> EngineConfig:
    """The engine settings the model options give. `max_batch` 1 for the commands that run one stream at a time
    (generate, bench): calibration then times single-sequence forwards alone, not batches no request will form."""
    draft = {"draft_confidence": args.draft_confidence, "draft_vocab": args.draft_vocab,
             "prompt_lookup": args.prompt_lookup}
    if args.fixed_k is not None and not speculate and not args.prompt_lookup:
        raise InvalidArgument("fixed_k: nothing is drafted with --no-spec (without --prompt-lookup), so there is no "
                              "k to fix")
    if args.fixed_k is not None:
        try:
            spec = SpecConfig(enabled=speculate, k_max=args.fixed_k, k_init=args.fixed_k, adaptive=False, **draft)
        except InvalidArgument as exc:  # its k_max is this flag's value: named as the flag the user gave
            raise InvalidArgument(field_as_option(str(exc), "k_max", "fixed_k")) from None
    else:
        spec = SpecConfig(enabled=speculate, k_max=args.k_max, k_init=min(SpecConfig().k_init, args.k_max), **draft)
    config = EngineConfig(spec=spec, decode_steps=args.decode_steps)
    return config if max_batch is None else dataclasses.replace(config, max_batch=max_batch)


def kv_tokens(args: argparse.Namespace) -> int:
    """--kv-tokens, checked: each runner's KV token budget (0: a share of the memory free at start); --retain-tokens
    checked with it."""
    if args.kv_tokens < 0:
        raise InvalidArgument(f"kv_tokens: must be non-negative (0: a share of free memory), got {args.kv_tokens}")
    check_retain_tokens(args.retain_tokens)
    return args.kv_tokens


def setup_torch(args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    import torch

    from tandem.core.device import select_device, select_dtype

    if args.threads is not None:
        if args.threads < 1:
            raise InvalidArgument(f"threads: must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    device = select_device(args.device)
    return device, select_dtype(args.dtype, device)


def pin_model_args(args: argparse.Namespace) -> None:
    """Check --target and --draft before anything starts: each must be a form a load can use (a mistyped path fails
    here, not after Ray and the gateway are up), and a hub id must be pinned to a commit, or with --allow-unpinned
    is replaced by its current commit here, once, so that every process loads that same commit."""
    from tandem.models.hub import pin_spec
    from tandem.models.source import check_spec

    for attr in ("target", "draft"):
        if getattr(args, attr, None):
            check_spec(getattr(args, attr))
            setattr(args, attr, pin_spec(getattr(args, attr), allow_unpinned=args.allow_unpinned))


def announce_compile(args: argparse.Namespace) -> None:
    """Say why a start with --compile takes minutes (on a terminal the runners' bars count the shape classes; -v logs
    each)."""
    scope = compile_scope(args.compile)
    if scope != "none":
        flag, whose = ("--compile-draft", "the draft's") if scope == "draft" else ("--compile", "each model's")
        print(f"tandem: {flag}: {whose} decode forwards compile before the first request (six shape "
              "classes, 1-2 min each on a 2-core CPU, less from a kept cache; `tandem -v` logs each)",
              file=sys.stderr, flush=True)


def load_models(args: argparse.Namespace, speculate: bool):
    """(target, draft or None), loaded and checked for a shared tokenizer. The caller has run pin_model_args first,
    before its heavy imports."""
    from tandem.models.loader import load_model, load_pair

    device, dtype = setup_torch(args)
    announce_compile(args)
    if not speculate:
        return load_model(args.target, device=device, dtype=dtype, eager=args.eager,
                          compile=compiles(args.compile, draft=False)), None
    draft, target = load_pair(args.draft, args.target, device=device, dtype=dtype, eager=args.eager,
                              draft_quantization=args.draft_quantization, compile=args.compile)
    return target, draft

