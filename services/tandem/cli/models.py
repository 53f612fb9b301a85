"""`tandem models ...`: pull registry models, list and verify the cache, write tiny test models."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tandem.errors import IntegrityError, InvalidArgument
from tandem.models.registry import PAIRS, REGISTRY, expand, known_names
from tandem.models.store import ModelStore


def add_models_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `models pull|list|verify|make-tiny`; each sub-command sets `handler(args) -> int` as a default."""
    parser = subparsers.add_parser("models")
    commands = parser.add_subparsers(dest="models_command", metavar="COMMAND", required=True)

    pull = commands.add_parser("pull", help="download, verify and convert registry models (idempotent)")
    pull.add_argument("names", nargs="+", metavar="NAME", help=f"one of: {', '.join(known_names())}")
    pull.add_argument("--keep-gguf", action="store_true", help="keep the assembled GGUF next to the HF dir")
    pull.add_argument("--force", action="store_true",
                      help="pull again even if pulled (after a failed verification, or to give a model pulled by an "
                           "older tandem the per-file hashes its manifest lacks)")
    pull.set_defaults(handler=cmd_pull)

    listing = commands.add_parser("list", help="show registry models and what is in the cache")
    listing.set_defaults(handler=cmd_list)

    verify = commands.add_parser("verify", help="re-hash pulled models' files against their manifests (as every "
                                                "load does)")
    verify.add_argument("names", nargs="*", metavar="NAME", help="models to check (default: every pulled model)")
    verify.set_defaults(handler=cmd_verify)

    tiny = commands.add_parser("make-tiny", help="write tiny random target/draft models for tests")
    tiny.add_argument("dir", type=Path, metavar="DIR", help="where the models go (made if missing)")
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    tiny.add_argument("--tokenizer-from", type=Path, default=None, metavar="HF_DIR",
                      help="copy the tokenizer of this HF directory instead of the built-in byte tokenizer")
    tiny.set_defaults(handler=cmd_make_tiny)
    return parser


def cmd_pull(args: argparse.Namespace) -> int:
    from tandem.models.pull import pull

    names = [model for name in args.names for model in expand(name)]
    for name in dict.fromkeys(names):
        path = pull(name, keep_gguf=args.keep_gguf, force=args.force)
        print(f"{name}\t{path}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Each model's outcome on one line; exit status 1 when any failed or could not be checked, so that a cron job
    or an init container can refuse a tampered cache before a server loads it."""
    from tandem.models.verify import verify_model_dir

    store = ModelStore()
    # A pair alias names its two models; any other name is looked up in the cache as it is.
    names = [model for name in args.names for model in (expand(name) if name in PAIRS else [name])] or \
        [model.name for model in store.list_models() if model.complete]
    failed = False
    for name in dict.fromkeys(names):
        if not store.is_complete(name):
            print(f"{name}\tnot pulled")
            failed = True
            continue
        started = time.monotonic()
        try:
            checked = verify_model_dir(store.hf_dir(name), name=name, progress=True)
        except IntegrityError as exc:
            print(f"{name}\tFAILED\t{exc}")
            failed = True
            continue
        if not checked:  # nothing to check against is no assurance: a gate on this command must not pass it
            print(f"{name}\tunverified\tits manifest predates per-file hashes: `tandem models pull --force {name}`")
            failed = True
            continue
        print(f"{name}\tverified\t{time.monotonic() - started:.1f}s")
    sys.stdout.flush()
    return 1 if failed else 0


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

    if args.dir.exists() and not args.dir.is_dir():
        raise InvalidArgument(f"dir: {args.dir} is a file; name a directory (made if missing)")
    made = make_tiny(args.dir, seed=args.seed, tokenizer_from=args.tokenizer_from)
    print(f"target\t{made.target}")
    print(f"draft\t{made.draft}")
    print(f"draft_random\t{made.draft_random}")
    return 0
