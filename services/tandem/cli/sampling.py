"""`tandem generate`'s sampling flags: a local run reads them as SamplingParams (sampling_params), a run on a gateway
(`--address`, cli.remote) sends the same attributes with its request.
"""

from __future__ import annotations

import argparse

from tandem.cli.formats import output_format
from tandem.core.config import DEFAULT_MAX_TOKENS, SamplingParams
from tandem.errors import InvalidArgument


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperature", type=float, default=1.0, help="0 is greedy (default: %(default)s)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    parser.add_argument("--top-k", type=int, default=0, help="0 disables (default: %(default)s)")
    parser.add_argument("--min-p", type=float, default=0.0,
                        help="drop tokens less likely than this times the most likely one; 0 disables (default: "
                             "%(default)s)")
    parser.add_argument("--seed", type=seed_value, default=None,
                        help="sampling seed, 0 to 2**63-1 (default: a random one)")
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
    parser.add_argument("--min-tokens", type=int, default=0,
                        help="no end-of-sequence or stop token id before this many tokens (default: %(default)s)")
    parser.add_argument("--prediction", metavar="FILE", default=None,
                        help="a file whose text the output is expected to repeat in large part (code or a document "
                             "being edited): where the output matches it, its tokens are verified as drafts; the "
                             "output is the same as without it")


def seed_value(text: str) -> int:
    """--seed's type: SamplingParams' range, so that a run on a gateway (a uint64 on the wire) and a local one refuse
    the same values the same way."""
    try:
        seed = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 0 <= seed < 2**63:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer below 2**63, got {seed}")
    return seed


def prediction_text(args: argparse.Namespace) -> str:
    """The text of --prediction's file ("" without one)."""
    if args.prediction is None:
        return ""
    try:
        with open(args.prediction, encoding="utf-8") as handle:
            return handle.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"prediction: cannot read {args.prediction}: {exc}") from None


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          seed=args.seed, max_tokens=args.max_tokens, stop=tuple(args.stop),
                          stop_token_ids=tuple(args.stop_token_ids),
                          ignore_eos=args.ignore_eos, repetition_penalty=args.repetition_penalty,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          output_format=output_format(args), min_tokens=args.min_tokens)
