"""The `tandem` command line: models, generate, bench."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from tandem import __version__
from tandem.errors import TandemError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Speculative-decoding LLM serving.")
    parser.add_argument("--version", action="version", version=f"tandem {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Each command's module is imported on its own: on the client install (no torch, Ray, ...) the server commands
    # are listed with a stub that says what to install, and `tandem generate --address` still works.
    for module, adder, name in (("models", "add_models_parser", "models"),
                                ("generate", "add_generate_parser", "generate"),
                                ("bench", "add_bench_parser", "bench"), ("serve", "add_serve_parser", "serve"),
                                ("pools", "add_pools_parser", "pools"), ("gateway", "add_gateway_parser", "gateway"),
                                ("canary", "add_canary_parser", "canary"), ("keys", "add_keys_parser", "keys")):
        try:
            add = getattr(importlib.import_module(f"tandem.cli.{module}"), adder)
        except ModuleNotFoundError as exc:
            if exc.name is None or exc.name.split(".")[0] == "tandem":  # our own bug, not a missing dependency
                raise
            _add_missing_stack_parser(subparsers, name, exc)
        else:
            add(subparsers)
    return parser


SERVER_INSTALL = "pip install 'tandem[server]'"


def _needs_server_stack(exc: ModuleNotFoundError) -> str:
    return (f"this command needs the server stack, which is not installed (no module {exc.name!r}): "
            f"{SERVER_INSTALL}")


def _add_missing_stack_parser(subparsers, name: str, exc: ModuleNotFoundError) -> None:
    parser = subparsers.add_parser(name, help=f"(needs {SERVER_INSTALL})", add_help=False)
    parser.add_argument("rest", nargs=argparse.REMAINDER)

    def refuse(args: argparse.Namespace) -> int:
        raise TandemError(f"tandem {name}: {_needs_server_stack(exc)}")

    parser.set_defaults(handler=refuse, missing_stack=True)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # A stub for a command whose stack is missing takes any arguments (argparse.REMAINDER misses leading options).
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "missing_stack", False):
        args = parser.parse_args(argv)  # reports the unknown arguments as argparse always does
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return int(args.handler(args) or 0)
    except TandemError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # e.g. local `tandem generate` (no --address) on the client install
        if exc.name is None or exc.name.split(".")[0] == "tandem":
            raise
        print(f"error: {_needs_server_stack(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
