"""Options shared by the commands that load models and sample."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import TYPE_CHECKING

from tandem.cli.formats import output_format
from tandem.cli.options import STDOUT, field_as_option, write_json
from tandem.core.config import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_RETAIN_TOKENS,
    QUANTIZATIONS,
    EngineConfig,
    SamplingParams,
    SpecConfig,
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
    parser.add_argument("--draft-vocab", type=int, default=SpecConfig().draft_vocab,
                        help="draft scores only the first N token ids (0: all); output stays exact")
    parser.add_argument("--draft-quantization", choices=QUANTIZATIONS, default="none",
                        help="hold the draft's weights as int8 (one scale per output row): a draft step reads half "
                             "the bytes; output stays exact, acceptance may drop slightly. int8 keeps the activations "
                             "in the model's dtype; w8a8 quantizes them too, per row, for oneDNN's int8 GEMM, the "
                             "fast one on an AVX-512 or AMX CPU; w4 adds an int4 copy (a scale and zero point per "
                             "group of 128 inputs) that one-row draft steps read, a quarter of the bf16 bytes "
                             "(default: none)")
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


def add_pool_options(parser: argparse.ArgumentParser) -> None:
    """How many workers of each pool, and where they land: `tandem serve` and `tandem pools start`."""
    parser.add_argument("--draft-workers", type=int, default=1, help="draft-worker actors (default: %(default)s)")
    parser.add_argument("--target-replicas", type=int, default=1, help="target replicas (default: %(default)s)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per target replica")
    parser.add_argument("--draft-gpus", type=float, default=0.0, help="GPUs per draft worker (default: 0)")
    parser.add_argument("--target-gpus", type=float, default=0.0, help="GPUs per target rank (default: 0)")
    parser.add_argument("--draft-resources", default=None, metavar="JSON",
                        help='custom Ray resources per draft worker, e.g. \'{"draft_pool": 1}\' (a worker group\'s)')
    parser.add_argument("--target-resources", default=None, metavar="JSON",
                        help='custom Ray resources per target rank, e.g. \'{"target_pool": 1}\'')


def add_bench_model_options(parser: argparse.ArgumentParser, dtype: str,
                            dtype_help: str = "both models' dtype") -> None:
    """--target, --draft, --dtype and --threads of a benchmark that loads the pair in its own process (2 threads by
    default: the machines the documented figures come from)."""
    parser.add_argument("--target", default=DEFAULT_TARGET, help="target model")
    parser.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model")
    parser.add_argument("--dtype", default=dtype, help=dtype_help)
    parser.add_argument("--threads", type=int, default=2, help="torch's CPU threads")


SESSIONS_REDIS = ("session state store, redis://[:PASSWORD@]host:port/db or rediss:// for TLS (default: $REDIS_URL, "
                  "else an embedded redis-server on 127.0.0.1 with a random password)")


def add_redis_options(parser: argparse.ArgumentParser, url_help: str = SESSIONS_REDIS) -> None:
    """Where session state (or what `url_help` says) lives, and the credentials to reach it (kept off the command line
    where possible)."""
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL"), help=url_help)
    parser.add_argument("--redis-password-file", default=os.environ.get("TANDEM_REDIS_PASSWORD_FILE"),
                        metavar="FILE", help="the Redis password, from a file (default: "
                        "$TANDEM_REDIS_PASSWORD_FILE; else $TANDEM_REDIS_PASSWORD, else the URL's own)")
    parser.add_argument("--redis-ca", default=os.environ.get("TANDEM_REDIS_CA"), metavar="FILE",
                        help="PEM CA bundle that signed the rediss:// server's certificate (default: $TANDEM_REDIS_CA, "
                             "else the system's CAs)")


def add_ray_token_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ray-token-file", default=None, metavar="FILE",
                        help="Ray token authentication: the cluster's token (default: $RAY_AUTH_TOKEN or "
                             "$RAY_AUTH_TOKEN_PATH, which Ray reads itself; a local cluster gets a random token)")


def session_store_url(args: argparse.Namespace) -> str | None:
    """--redis-url with the password and CA of the other flags folded in (None: the embedded Redis)."""
    from tandem.sessions.connection import configured_password, with_credentials

    if not args.redis_url or args.redis_url == "memory":
        # Credentials for no URL are a URL left out (a typo'd variable, a missing flag): the process would run on
        # a store of its own and its gateways would not share sessions, with nothing said.
        store = "its sessions live in its memory" if args.redis_url else "it runs an embedded Redis of its own"
        for field, value in (("redis_password_file", args.redis_password_file), ("redis_ca", args.redis_ca)):
            if value:
                raise InvalidArgument(f"{field}: given for no --redis-url (or $REDIS_URL), where {store}; pass the "
                                      f"URL of the Redis it is for")
        return args.redis_url or None
    return with_credentials(args.redis_url, configured_password(args.redis_password_file), args.redis_ca)


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperature", type=float, default=1.0, help="0 is greedy (default: %(default)s)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    parser.add_argument("--top-k", type=int, default=0, help="0 disables (default: %(default)s)")
    parser.add_argument("--min-p", type=float, default=0.0,
                        help="drop tokens less likely than this times the most likely one; 0 disables (default: "
                             "%(default)s)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (default: a random one)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="above 1 discourages every token already in the context (default: %(default)s, none)")
    parser.add_argument("--presence-penalty", type=float, default=0.0,
                        help="-2 to 2, subtracted once from each token the output holds (default: %(default)s)")
    parser.add_argument("--frequency-penalty", type=float, default=0.0,
                        help="-2 to 2, subtracted per time the output holds the token (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="most tokens to generate")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--stop-token-id", type=int, action="append", default=[], dest="stop_token_ids",
                        help="stop token id (repeatable)")  # dest: errors name the field, and so the flag
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          seed=args.seed, max_tokens=args.max_tokens, stop=tuple(args.stop),
                          stop_token_ids=tuple(args.stop_token_ids),
                          ignore_eos=args.ignore_eos, repetition_penalty=args.repetition_penalty,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          output_format=output_format(args))


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
    draft = {"draft_confidence": args.draft_confidence, "draft_vocab": args.draft_vocab}
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
    """Say why a start with --compile is quiet for minutes (the runners' per-class progress is logged with -v)."""
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


def print_outcome(json_target: str | None, text: str | None, token_ids: list[int], finish_reason: str,
                  prompt_tokens: int, elapsed: float, first_token_at: float | None, speculative: bool, stats: dict,
                  **extra) -> None:
    """The end of `tandem generate`, local or remote: a summary line after the streamed text, and the JSON object
    where `--json` asked for it (stdout instead of the text, or a file)."""
    if json_target != STDOUT:
        sys.stdout.write("\n")
        # An acceptance rate only where something was drafted (0.00 read as every draft rejected).
        drafted = stats.get("drafted", 1)
        acceptance = f", acceptance {stats['acceptance_rate']:.2f}" if speculative and drafted else ""
        print(f"[{len(token_ids)} tokens, {elapsed:.2f}s, finish: {finish_reason}{acceptance}]", file=sys.stderr)
    write_json(json_target, {
        "text": text,
        "token_ids": token_ids,
        "finish_reason": finish_reason,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(token_ids),
        "seconds": round(elapsed, 4),
        "time_to_first_token": round(first_token_at if first_token_at is not None else elapsed, 4),
        "tokens_per_second": round(len(token_ids) / elapsed, 3) if elapsed > 0 else None,
        "speculative": speculative,
        "stats": stats,
        **extra,
    })


def add_worker_metrics_option(parser: argparse.ArgumentParser) -> None:
    """--worker-metrics-port: `tandem serve` and `tandem pools start`."""
    from tandem.telemetry.worker import DEFAULT_WORKER_METRICS_PORT, METRICS_PORT_ENV

    parser.add_argument("--worker-metrics-port", type=int, default=None,
                        help=f"first /metrics port of each Ray worker (default: ${METRICS_PORT_ENV} or "
                        f"{DEFAULT_WORKER_METRICS_PORT}; taken: the next free one; 0: a free port; -1: off)")
    parser.set_defaults(no_metrics=False)  # `tandem serve --no-metrics` turns the workers' off too


def worker_metrics_port(args: argparse.Namespace) -> int:
    """The port Ray workers serve /metrics on (-1: off), handed to them as $TANDEM_WORKER_METRICS_PORT."""
    from tandem.telemetry.worker import DEFAULT_WORKER_METRICS_PORT, METRICS_PORT_ENV

    if args.no_metrics:
        return -1
    port = args.worker_metrics_port
    if port is None:
        port = int(os.environ.get(METRICS_PORT_ENV) or DEFAULT_WORKER_METRICS_PORT)
    if not -1 <= port <= 65535:
        raise InvalidArgument(f"worker_metrics_port: must be between -1 (off) and 65535, got {port}")
    return port
