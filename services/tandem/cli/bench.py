"""`tandem bench`: plain vs Hugging Face assisted vs tandem on the same loaded models, one JSON report."""

from __future__ import annotations

import argparse
import json

from tandem.bench.prompts import DEFAULT_PROMPTS, PROMPT_SETS
from tandem.cli.common import add_model_options, engine_config, kv_tokens, load_models, pin_model_args
from tandem.cli.options import add_json_option, add_prompts_option, wants_text, write_json
from tandem.errors import InvalidArgument

# tandem.bench.core's METHODS, named here too: that module imports torch, and the parser must not (`tandem bench
# --help` stays quick). tests/test_cli.py checks that the two agree.
METHODS = ("plain", "hf_plain", "hf_assisted", "tandem")


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench")
    add_model_options(parser, cache_reuse=False)  # each method computes every prompt whole
    add_prompts_option(parser, PROMPT_SETS, DEFAULT_PROMPTS)
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt and method")
    parser.add_argument("--num-prompts", type=int, default=None, metavar="N",
                        help="use only the first N prompts (default: all)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS), metavar="METHOD",
                        help=f"the methods to run, of {' '.join(METHODS)} (default: all)")
    add_json_option(parser, "the report", printed=True)
    parser.set_defaults(handler=run)


def _standard_models(args: argparse.Namespace, target, draft, methods: tuple[str, ...]):
    """Hugging Face's methods measured the standard way: when tandem's models were prepared for its fast path
    (prepacked linears, an int8 draft), load a second, untouched copy for them; None when tandem's are standard."""
    from tandem.bench.core import HF_METHODS
    from tandem.core.packed_linear import PackedLinear

    prepared = any(isinstance(m, PackedLinear) for loaded in (target, draft) for m in loaded.model.modules())
    if not any(m in HF_METHODS for m in methods) or not (prepared or draft.quantization != "none"):
        return None
    from tandem.models.loader import load_model

    device, dtype = target.model.device, target.model.dtype
    return (load_model(args.target, device=device, dtype=dtype, eager=True),
            load_model(args.draft, device=device, dtype=dtype, eager=True))


def run(args: argparse.Namespace) -> int:
    pin_model_args(args)  # a mistyped model path fails before the imports below (seconds)
    from tandem.bench.core import run_bench
    from tandem.bench.prompts import load_prompts

    methods = tuple(dict.fromkeys(args.methods))
    if args.max_tokens < 1:
        raise InvalidArgument(f"max_tokens: must be at least 1, got {args.max_tokens}")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise InvalidArgument(f"num_prompts: must be at least 1, got {args.num_prompts}")
    budget = kv_tokens(args)
    prompts = load_prompts(args.prompts)[: args.num_prompts]
    target, draft = load_models(args, speculate=True)
    report = run_bench(target, draft, prompts, args.max_tokens, methods, engine_config(args, max_batch=1),
                       hf_models=_standard_models(args, target, draft, methods), kv_tokens=budget)
    report["config"] |= {"target": args.target, "draft": args.draft}
    # The report is the command's output: printed as text would be, and also written where --json PATH says.
    if wants_text(args):
        print(json.dumps(report, indent=2))
    write_json(args.json, report)
    return 0
