"""`tandem generate`: one prompt through the in-process engine, streamed or as JSON."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from tandem.cli.common import (
    add_calibration_file_option,
    add_model_options,
    calibration_file,
    engine_config,
    kv_tokens,
    load_models,
    local_options,
    pin_model_args,
)
from tandem.cli.formats import add_format_options, check_compiles
from tandem.cli.options import STDOUT, add_json_option, wants_text
from tandem.cli.outcome import print_outcome
from tandem.cli.remote import add_address_option
from tandem.cli.sampling import add_sampling_options, prediction_text, sampling_params
from tandem.errors import InvalidArgument


def add_generate_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate")
    # Optional to argparse so that a prompt taken by `--json` as its PATH gets a message that says so.
    parser.add_argument("prompt", nargs="?", help="prompt text")
    add_model_options(parser)
    add_sampling_options(parser)
    add_format_options(parser)
    parser.add_argument("--no-spec", action="store_true", help="plain target decoding through the same engine")
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template")
    add_calibration_file_option(parser)
    add_json_option(parser, "the text, token ids and statistics")
    add_address_option(parser)
    parser.set_defaults(handler=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    if args.prompt is None:
        taken = f": --json took {args.json!r} as the file to write; put the prompt before --json, or write " \
            "--json -- PROMPT for the JSON on stdout" if args.json not in (None, STDOUT) else ""
        raise InvalidArgument(f"prompt: missing{taken}")
    if args.address:
        from tandem.cli.remote import run_remote_generate

        return run_remote_generate(args)
    pin_model_args(args)  # a mistyped model path fails before the imports below (seconds)
    # Imported here: --address needs only the client install, these need the server stack (torch).
    from tandem.core.detok import IncrementalDetokenizer
    from tandem.engines.local import build_engine, encode_prompt
    from tandem.models.loader import eos_token_ids

    params = sampling_params(args)
    prediction = prediction_text(args)  # an unreadable file fails before the models load
    speculate = not args.no_spec
    config = engine_config(args, speculate, max_batch=1)
    budget = kv_tokens(args)
    costs_file = calibration_file(args) if config.calibrates(speculate) else ""
    target, draft = load_models(args, speculate)
    if params.output_format is not None:  # before the engine is built and calibrated
        check_compiles(args, params.output_format, target.tokenizer, eos_token_ids(target.model, target.tokenizer))
    engine = build_engine(target, draft, dataclasses.replace(config, calibrate=not costs_file), kv_tokens=budget,
                          retain_tokens=args.retain_tokens, prefix_cache=args.prefix_cache)
    if costs_file:  # costs kept from an earlier run of this setup, as `tandem serve` keeps them
        from tandem.engines import Arm, BuildOptions
        from tandem.engines.calibration_file import reuse_or_calibrate

        arm = Arm("", args.draft, config)
        reuse_or_calibrate(costs_file, BuildOptions(args.target, (arm,), local_options(args)), arm, engine)
    prompt_ids = encode_prompt(target.tokenizer, args.prompt, args.chat)
    started = time.perf_counter()
    first_token_at = None
    predicted = target.tokenizer.encode(prediction, add_special_tokens=False) if prediction else None
    request_id = engine.add_request(prompt_ids, params, prediction=predicted)
    seq = engine.sequences[request_id]
    detok = IncrementalDetokenizer(engine.decode, params.stop)
    while engine.has_unfinished():
        for out in engine.step():
            first_token_at = first_token_at or time.perf_counter()
            delta = detok.push(out.new_token_ids, final=out.finish_reason is not None, cut=seq.text_cut)
            if wants_text(args) and delta:
                sys.stdout.write(delta)
                sys.stdout.flush()
    elapsed = time.perf_counter() - started
    result = engine.result(seq)
    print_outcome(args.json, result.text, result.token_ids, result.finish_reason, len(prompt_ids), elapsed,
                  first_token_at and first_token_at - started, speculate, result.stats)
    return 0
