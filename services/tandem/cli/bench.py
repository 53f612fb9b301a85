"""`tandem bench`: plain vs Hugging Face assisted vs tandem on the same loaded models, one JSON report."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tandem.bench.runner import HF_METHODS, METHODS, load_prompts, run_bench
from tandem.cli.common import add_model_options, engine_config, kv_tokens, load_models
from tandem.core.packed_linear import PackedLinear
from tandem.errors import InvalidArgument


def add_bench_parser(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="benchmark plain, HF assisted and tandem decoding")
    add_model_options(parser)
    parser.add_argument("--prompts", type=Path, default=None, help="JSONL file, one {\"prompt\": ...} per line")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of %(default)s")
    parser.add_argument("--json", dest="json_out", type=Path, default=None, help="write the report here")
    parser.set_defaults(handler=run)


def _standard_models(args: argparse.Namespace, target, draft, methods: tuple[str, ...]):
    """Hugging Face's methods measured the standard way: when tandem's models were prepared for its fast path
    (prepacked linears), load a second, untouched copy for them; None when tandem's are already standard."""
    if not any(m in HF_METHODS for m in methods) or not any(
            isinstance(m, PackedLinear) for loaded in (target, draft) for m in loaded.model.modules()):
        return None
    from tandem.models.loader import load_model

    device, dtype = target.model.device, target.model.dtype
    return (load_model(args.target, device=device, dtype=dtype, eager=True),
            load_model(args.draft, device=device, dtype=dtype, eager=True))


def run(args: argparse.Namespace) -> int:
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    if unknown := [m for m in methods if m not in METHODS]:
        raise InvalidArgument(f"methods: unknown {unknown}; choose from {', '.join(METHODS)}")
    if args.max_tokens < 1:
        raise InvalidArgument(f"max_tokens: must be at least 1, got {args.max_tokens}")
    budget = kv_tokens(args)
    prompts = load_prompts(args.prompts)[: args.limit]
    target, draft = load_models(args, speculate=True)
    report = run_bench(target, draft, prompts, args.max_tokens, methods, engine_config(args),
                       hf_models=_standard_models(args, target, draft, methods), kv_tokens=budget)
    report["config"] |= {"target": args.target, "draft": args.draft}
    text = json.dumps(report, indent=2)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(text + "\n")
    print(text)
    return 0
