"""The `tandem` command line: models, generate, bench."""

from __future__ import annotations

import argparse
import logging
import sys

from tandem import __version__
from tandem.errors import TandemError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Speculative-decoding LLM serving.")
    parser.add_argument("--version", action="version", version=f"tandem {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from tandem.cli.bench import add_bench_parser
    from tandem.cli.canary import add_canary_parser
    from tandem.cli.gateway import add_gateway_parser
    from tandem.cli.generate import add_generate_parser
    from tandem.cli.models import add_models_parser
    from tandem.cli.pools import add_pools_parser
    from tandem.cli.serve import add_serve_parser

    add_models_parser(subparsers)
    add_generate_parser(subparsers)
    add_bench_parser(subparsers)
    add_serve_parser(subparsers)
    add_pools_parser(subparsers)
    add_gateway_parser(subparsers)
    add_canary_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return int(args.handler(args) or 0)
    except TandemError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
