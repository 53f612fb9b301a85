"""Conventions every tandem command and benchmark shares, so a flag means the same thing wherever it appears.

- `--json [PATH]`: alone, print one JSON object on stdout instead of text; with PATH, also write it there.
- Lists are space-separated (`nargs="+"`), never comma-separated.
- `--prompts`: the name of a shipped prompt set, or the path of a JSONL file with one {"prompt": ...} per line.
- Help shows every default (DefaultsHelpFormatter).

Imports only the standard library: `tandem --help` and the benchmarks that run without the server stack use it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

STDOUT = "-"


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in every option's help, without repeating one the help text already states."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if "default" in help_text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return help_text
        return super()._get_help_string(action)


def add_json_option(parser: argparse.ArgumentParser, what: str = "the result") -> None:
    parser.add_argument("--json", nargs="?", const=STDOUT, default=None, metavar="PATH",
                        help=f"{what} as one JSON object: on stdout when PATH is left out, else written to PATH")


def write_json(target: str | Path | None, payload: Any) -> None:
    """Write `payload` where `--json` asked: stdout for `--json` alone, else the file (its folder made)."""
    if target is None:
        return
    text = json.dumps(payload, indent=2, default=str)
    if str(target) == STDOUT:
        print(text, file=sys.stdout, flush=True)
        return
    path = Path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def wants_text(args: argparse.Namespace) -> bool:
    """Whether the command prints its human-readable output (it does unless the JSON goes to stdout)."""
    return getattr(args, "json", None) != STDOUT
