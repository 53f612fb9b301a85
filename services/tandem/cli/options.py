"""Conventions every tandem command and benchmark shares, so a flag means the same thing wherever it appears.

- `--json [PATH]`: alone, print one JSON object on stdout instead of text; with PATH, also write it there.
- Lists are space-separated (`nargs="+"`), never comma-separated.
- `--prompts`: the name of a shipped prompt set, or the path of a JSONL file with one {"prompt": ...} per line.
- Help shows every default (DefaultsHelpFormatter).
- Errors name the flag: a config's "port: must be ..." reaches the user as "--port: must be ..." (name_flags).

Imports only the standard library: `tandem --help` and the benchmarks that run without the server stack use it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

STDOUT = "-"


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in every option's help, without repeating one the help text already states. A switch (default
    False), an option unset by default (None, "") and a repeatable one that starts empty show none; a list shows
    as it is typed, space-separated."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        default = action.default
        # `is`, not `in (None, False)`: 0 == False, and a default of 0 is worth showing.
        unset = default is None or default is False or default is argparse.SUPPRESS or default in ("", [], ())
        if "default" in help_text or unset or not action.option_strings:
            return help_text
        if isinstance(default, list | tuple):
            shown = " ".join(str(value) for value in default).replace("%", "%%")
        else:
            shown = "%(default)s"
        return f"{help_text} (default: {shown})"


def add_json_option(parser: argparse.ArgumentParser, what: str = "the result", printed: bool = False) -> None:
    """printed: the command prints that JSON as its text output too, so a PATH gets a copy."""
    where = "on stdout, and also written to PATH if given" if printed else \
        "on stdout when PATH is left out, else written to PATH"
    parser.add_argument("--json", nargs="?", const=STDOUT, default=None, metavar="PATH", type=json_target,
                        help=f"{what} as one JSON object: {where}")


def json_target(value: str) -> str:
    """--json's PATH, checked when the command line is read: a benchmark finds out that it cannot write its report
    before its run, not after it (the figures would be lost)."""
    if value == STDOUT:
        return value
    path = Path(value)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{value} is a directory; name a file in it")
    folder = next(parent for parent in path.absolute().parents if parent.exists())  # write_json makes the rest
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {value}: {folder} is a file")
    if not os.access(path if path.exists() else folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {value}: permission denied")
    return value


def write_json(target: str | Path | None, payload: Any) -> None:
    """Write `payload` where `--json` asked: stdout for `--json` alone, else the file (its folder made).

    On stdout the object takes one line, so that a script can take the last line of output that starts with "{"
    (the Helm chart's pool reconciler reads `tandem pools status --json` so); a file gets it indented for people."""
    if target is None:
        return
    if str(target) == STDOUT:
        print(json.dumps(payload, default=str), file=sys.stdout, flush=True)
        return
    path = Path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")


def wants_text(args: argparse.Namespace) -> bool:
    """Whether the command prints its human-readable output (it does unless the JSON goes to stdout)."""
    return getattr(args, "json", None) != STDOUT


def add_prompts_option(parser: argparse.ArgumentParser, sets: Sequence[str], default: str) -> None:
    """`--prompts SET|FILE`; the command resolves the value (a name in `sets` first, else a path)."""
    parser.add_argument("--prompts", default=default, metavar="SET|FILE",
                        help=f"a shipped prompt set ({', '.join(sets)}) or the path of a JSONL file, one "
                             '{"prompt": ...} per line')


# A field named at the start of an error message, or after "; " where one message reports several fields.
_FIELD = re.compile(r"(^|; )([a-z][a-z0-9_]*):")


def flag_names(parsers: Iterable[argparse.ArgumentParser]) -> dict[str, str]:
    """{dest: the flag that sets it} over the parsers' options, the long form where there is one
    (`kv_tokens` -> `--kv-tokens`, `tp` -> `--tp`); positionals have no flag and are left out."""
    flags: dict[str, str] = {}
    for parser in parsers:
        for action in parser._actions:
            if action.option_strings:
                long = [option for option in action.option_strings if option.startswith("--")]
                flags.setdefault(action.dest, (long or action.option_strings)[0])
    return flags


def field_as_option(message: str, field: str, dest: str) -> str:
    """`message`, when it starts with a config's `field`, starting with the option `dest` that set it instead: for
    a flag whose name is not the field's (--fixed-k sets k_max, --max-tokens-limit max_tokens), before name_flags
    names the flag."""
    return dest + message[len(field):] if message.startswith(f"{field}:") else message


def refuse_bad_values(parser: argparse.ArgumentParser, checks: Iterable[tuple[str, bool, str]]) -> None:
    """A benchmark's checks of its values before any work, each (field, ok, message): the first that fails exits
    with one line naming the flag (`error: --calls: must be at least 1, got 0`), status 2, as the tandem CLI does."""
    for field, ok, message in checks:
        if not ok:
            parser.exit(2, f"error: {name_flags(f'{field}: {message}', flag_names([parser]))}\n")


def at_least(args: argparse.Namespace, **minimums: int) -> list[tuple[str, bool, str]]:
    """refuse_bad_values' checks that each named value (a list: its least) is at least its minimum."""
    values = {name: min(v) if isinstance(v := getattr(args, name), list) else v for name in minimums}
    return [(name, values[name] >= least, f"must be at least {least}, got {values[name]}")
            for name, least in minimums.items()]


def name_flags(message: str, flags: Mapping[str, str]) -> str:
    """`message` with each field that a flag sets named by that flag: configs name their fields ("port: must be
    ..."), the user typed flags ("--port"). A field no flag sets keeps its name."""
    return _FIELD.sub(lambda match: f"{match.group(1)}{flags.get(match.group(2), match.group(2))}:", message)
