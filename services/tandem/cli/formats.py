"""`tandem generate`'s structured outputs: --json-object, --json-schema SCHEMA, --regex EXPR, --grammar GRAMMAR and
--structural-tag TAG (one at most).

A remote run sends them as the Python client's response_format mapping; a local one gives the engine the same format
as an OutputFormat, checked to compile before generating. Errors name the flag: a schema that is not JSON is
"--json-schema: ...". Imported by the client-install path (`--address`): tandem.core is imported only by the
functions a local run calls.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.errors import InvalidArgument
from tandem.response_format import schema_text, structural_tag_text

if TYPE_CHECKING:
    from tandem.core.config import OutputFormat


def add_format_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    group.add_argument("--json-schema", default=None, metavar="SCHEMA",
                       help="the output is JSON that follows this JSON schema: its text, or @PATH to read it from a "
                            "file")
    group.add_argument("--regex", default=None, metavar="EXPR",
                       help="the whole output matches this regular expression")
    group.add_argument("--grammar", default=None, metavar="GRAMMAR",
                       help="the whole output matches this grammar, Lark (llguidance's) or GBNF (llama.cpp's): its "
                            "text, or @PATH to read it from a file")
    group.add_argument("--structural-tag", default=None, metavar="TAG",
                       help="free text but for tagged parts, each JSON its structure's schema accepts (vLLM's "
                            'structural tag: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}): its '
                            "JSON text, or @PATH to read it from a file")


def response_format(args: argparse.Namespace) -> dict[str, Any] | None:
    """The format the flags ask for, in the shape TandemClient takes; None for free text."""
    if args.json_object:
        return {"type": "json_object"}
    if args.json_schema is not None:
        return {"type": "json_schema", "json_schema": {"name": "tandem-generate", "schema": _schema(args.json_schema)}}
    if args.regex is not None:
        if not args.regex:
            raise InvalidArgument("regex: must be a non-empty expression")
        return {"type": "regex", "regex": args.regex}
    if args.grammar is not None:
        grammar = _read("grammar", args.grammar)
        if not grammar.strip():
            raise InvalidArgument("grammar: must be a non-empty grammar")
        return {"type": "grammar", "grammar": grammar}
    if args.structural_tag is not None:  # checked as the server checks it (tandem.response_format.structural_tags)
        tag = structural_tag_text(_read("structural_tag", args.structural_tag), "structural_tag")
        return {"type": "structural_tag", **json.loads(tag)}
    return None


def output_format(args: argparse.Namespace) -> OutputFormat | None:
    """The format the flags ask for, as the engine takes it."""
    from tandem.core.config import OutputFormat

    wanted = response_format(args)
    if wanted is None:
        return None
    if wanted["type"] == "json_object":
        return OutputFormat.json_object()
    if wanted["type"] == "json_schema":
        return OutputFormat("json_schema", wanted["json_schema"]["schema"])  # its text (_schema)
    if wanted["type"] == "grammar":
        return OutputFormat("grammar", wanted["grammar"])
    if wanted["type"] == "structural_tag":
        return OutputFormat("structural_tag", structural_tag_text(wanted, "structural_tag"))
    return OutputFormat("regex", wanted["regex"])


def check_compiles(args: argparse.Namespace, output_format: OutputFormat, tokenizer: Any,
                   eos_token_ids: Collection[int]) -> None:
    """Refuse a format the model's tokenizer cannot follow before any token is generated, naming the flag."""
    from tandem.core.formats import check_format, format_tokenizer

    try:
        check_format(output_format, format_tokenizer(tokenizer, eos_token_ids))
    except InvalidArgument as exc:
        flag = next((name for name in ("json_schema", "regex", "grammar", "structural_tag")
                     if getattr(args, name) is not None), "json_object")
        raise InvalidArgument(str(exc).replace("response_format", flag, 1)) from None


def _schema(value: str) -> str:
    """--json-schema's schema as JSON text: given, or read from the file @PATH names."""
    return schema_text(_read("json_schema", value), "json_schema", "the schema")


def _read(flag: str, value: str) -> str:
    """A flag's text: given, or read from the file @PATH names."""
    if not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text()
    except OSError as exc:
        raise InvalidArgument(f"{flag}: cannot read {value[1:]}: {exc.strerror}") from None
