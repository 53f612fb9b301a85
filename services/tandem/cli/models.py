"""`tandem models ...`: pull registry models, list the cache, write tiny test models."""

from __future__ import annotations

import argparse
from pathlib import Path

from tandem.models.registry import REGISTRY, expand, known_names
from tandem.models.store import ModelStore


def add_models_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `models pull|list|make-tiny`; each sub-command sets `handler(args) -> int` as a default."""
    parser = subparsers.add_parser("models", help="pull, list and make models")
    commands = parser.add_subparsers(dest="models_command", metavar="COMMAND", required=True)

    pull = commands.add_parser("pull", help="download, verify and convert registry models (idempotent)")
    pull.add_argument("names", nargs="+", metavar="NAME", help=f"one of: {', '.join(known_names())}")
    pull.add_argument("--keep-gguf", action="store_true", help="keep the assembled GGUF next to the HF dir")
    pull.set_defaults(handler=cmd_pull)

    listing = commands.add_parser("list", help="show registry models and what is in the cache")
    listing.set_defaults(handler=cmd_list)

    tiny = commands.add_parser("make-tiny", help="write tiny random target/draft models for tests")
    tiny.add_argument("dir", type=Path, metavar="DIR")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--tokenizer-from", type=Path, default=None, metavar="HF_DIR",
                      help="copy the tokenizer of this HF directory instead of the built-in byte tokenizer")
    tiny.set_defaults(handler=cmd_make_tiny)
    return parser


def cmd_pull(args: argparse.Namespace) -> int:
    from tandem.models.pull import pull

    names = [model for name in args.names for model in expand(name)]
    for name in dict.fromkeys(names):
        path = pull(name, keep_gguf=args.keep_gguf)
        print(f"{name}\t{path}")
    return 0


def format_size(size_bytes: int) -> str:
    size = float(size_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def cmd_list(args: argparse.Namespace) -> int:
    store = ModelStore()
    cached = {model.name: model for model in store.list_models()}
    rows = [("NAME", "STATUS", "SIZE", "PATH")]
    for name in dict.fromkeys([*REGISTRY, *cached]):
        model = cached.get(name)
        if model is None:
            rows.append((name, "not pulled", "-", "-"))
        else:
            status = "ready" if model.complete else "incomplete"
            rows.append((name, status, format_size(model.size_bytes), str(model.path)))
    widths = [max(len(row[col]) for row in rows) for col in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) + "  " + row[3])
    print(f"cache: {store.root}")
    return 0


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from tandem.models.tiny import make_tiny

    made = make_tiny(args.dir, seed=args.seed, tokenizer_from=args.tokenizer_from)
    print(f"target\t{made.target}")
    print(f"draft\t{made.draft}")
    print(f"draft_random\t{made.draft_random}")
    return 0
