"""`tandem generate`'s output format flags (--json-schema, --json-object, --regex, --grammar): a bad one, or two
together, is refused with exit code 2 and an error that names the flag. The formats at work are
tests/test_structured_outputs.py's."""

from __future__ import annotations

import pytest

from tandem.cli.main import main


@pytest.mark.parametrize(("flags", "message"), [
    (["--json-schema", "{nope"], "error: --json-schema: the schema is not JSON"),
    (["--json-schema", "[1]"], "error: --json-schema: the schema must be a JSON object"),
    (["--json-schema", "@/nonexistent/schema.json"], "error: --json-schema: cannot read"),
    (["--json-schema", '{"type": "wat"}'], "error: --json-schema: Invalid type: wat"),
    (["--regex", "(("], "error: --regex:"),
    (["--grammar", "root ::= (("], "error: --grammar: the grammar is neither Lark nor GBNF"),
    (["--json-object", "--ignore-eos"], "error: --ignore-eos: cannot combine"),
], ids=["not-json", "not-an-object", "no-file", "wat", "bad-regex", "bad-grammar", "ignore-eos"])
def test_cli_errors_name_the_flag(tiny_dirs, capsys, flags: list[str], message: str) -> None:
    code = main(["generate", "x", "--target", str(tiny_dirs.target), "--no-spec", "--dtype", "float32", *flags])
    assert code == 2 and message in capsys.readouterr().err


def test_cli_format_flags_exclude_each_other(tiny_dirs, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["generate", "x", "--target", str(tiny_dirs.target), "--json-object", "--regex", "a"])
    assert exited.value.code == 2 and "not allowed with" in capsys.readouterr().err
