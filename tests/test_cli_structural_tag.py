"""`tandem generate --structural-tag TAG`: vLLM's structural tag from the command line, in-process and through a
gateway (`--address`, gRPC), over the tiny random-weight pair. A random model writes no JSON of its own, so every
tagged part that parses below does because the tag reached the engine."""

from __future__ import annotations

import json
import re
import string

import jsonschema
import pytest

from gateway_harness import ServerThread, tiny_backend
from tandem.cli.main import main

TAG_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False, "x-guidance": {"whitespace_pattern": "[ ]{0,1}"}}
# `tandem generate` has no logit bias to make the random model write a trigger: every ASCII letter is one (it writes
# one every few tokens), and a part runs from its letter to the closing "@", which the schema's JSON cannot hold.
TAG = {"triggers": list(string.ascii_letters),
       "structures": [{"begin": letter, "schema": TAG_SCHEMA, "end": "@"} for letter in string.ascii_letters]}
PART = r"[A-Za-z][^@]*@"
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def server(tiny_models):
    running = ServerThread(tiny_backend(tiny_models[0], tiny_models[1]))
    yield running
    running.stop()


def _tagged_parts(out: dict) -> list[dict]:
    """The JSON of each whole tagged part of `tandem generate --json`'s output, each checked against the schema;
    the text between parts holds no letter (each one opened a part), but for one part cut at max_tokens."""
    text = out["text"]
    rest = re.sub(PART, "", text)
    if out["finish_reason"] == "length":
        rest = re.sub(r"[A-Za-z][^@]*$", "", rest)
    assert not re.search(r"[A-Za-z]", rest), text
    parts = [json.loads(part[1:-1]) for part in re.findall(PART, text)]
    for part in parts:
        jsonschema.validate(part, TAG_SCHEMA)
    assert len(parts) >= 3, text
    return parts


def _error_line(capsys) -> str:
    """The one line an error printed: the last on stderr (loading progress comes before it), no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err.splitlines()[-1]


def test_tagged_parts_follow_the_schema_locally_from_a_file(tiny_dirs, tmp_path, capsys) -> None:
    tag_file = tmp_path / "tag.json"
    tag_file.write_text(json.dumps(TAG | {"type": "structural_tag"}))  # the response_format shape is taken too
    assert main(["generate", "Colour:", "--target", str(tiny_dirs.target), "--draft", str(tiny_dirs.draft),
                 "--dtype", "float32", "--fixed-k", "4", "--seed", "5", "--max-tokens", str(MAX_TOKENS),
                 "--structural-tag", f"@{tag_file}", "--json"]) == 0
    _tagged_parts(json.loads(capsys.readouterr().out))


def test_tagged_parts_follow_the_schema_through_a_gateway(server, capsys) -> None:
    remote = ["generate", "Colour:", "--address", server.address, "--seed", "5", "--max-tokens", str(MAX_TOKENS)]
    assert main([*remote, "--structural-tag", json.dumps(TAG), "--json"]) == 0
    _tagged_parts(json.loads(capsys.readouterr().out))
    # The server compiles the tag: a schema llguidance cannot follow is its INVALID_ARGUMENT, one line.
    wat = {"triggers": ["@"], "structures": [{"begin": "@", "schema": {"type": "wat"}, "end": "@"}]}
    assert main([*remote, "--structural-tag", json.dumps(wat)]) == 2
    assert "INVALID_ARGUMENT" in (err := capsys.readouterr().err) and "Invalid type: wat" in err


BAD = [
    ("{nope", "the structural_tag is not JSON"),
    ("", "the structural_tag is not JSON"),
    ("[1]", 'a structural_tag is an object with "structures" and "triggers"'),
    (json.dumps(TAG | {"triggers": []}), "structural_tag.triggers must be a non-empty list"),
    (json.dumps(TAG | {"triggers": ["<"]}), "structural_tag.structures[0].begin 'a' starts with none of the triggers"),
    (json.dumps({"triggers": ["@"], "structures": [{"begin": "@", "end": "@"}]}),
     "structural_tag.structures[0].schema is required"),
    ("@/nonexistent/tag.json", "cannot read /nonexistent/tag.json"),
]
BAD_IDS = ["not-json", "empty", "not-an-object", "no-triggers", "begin-without-trigger", "no-schema", "no-file"]


@pytest.mark.parametrize(("tag", "says"), BAD, ids=BAD_IDS)
def test_a_bad_tag_is_one_line_naming_the_flag_locally(tiny_dirs, capsys, tag: str, says: str) -> None:
    code = main(["generate", "x", "--target", str(tiny_dirs.target), "--no-spec", "--dtype", "float32",
                 "--structural-tag", tag])
    line = _error_line(capsys)
    assert code == 2 and line.startswith("error: --structural-tag: ") and says in line, line


@pytest.mark.parametrize(("tag", "says"), BAD, ids=BAD_IDS)
def test_a_bad_tag_is_refused_before_connecting(capsys, tag: str, says: str) -> None:
    """Checked as the server checks it, before any connection: nothing listens at this address."""
    code = main(["generate", "x", "--address", "127.0.0.1:9", "--structural-tag", tag])
    line = _error_line(capsys)
    assert code == 2 and line.startswith("error: --structural-tag: ") and says in line, line


def test_a_schema_that_does_not_compile_is_one_line_locally(tiny_dirs, capsys) -> None:
    wat = {"triggers": ["@"], "structures": [{"begin": "@", "schema": {"type": "wat"}, "end": "@"}]}
    code = main(["generate", "x", "--target", str(tiny_dirs.target), "--no-spec", "--dtype", "float32",
                 "--structural-tag", json.dumps(wat)])
    assert code == 2 and _error_line(capsys) == "error: --structural-tag: failed to compile JSON schema: Invalid " \
                                                "type: wat"


def test_the_flag_excludes_the_other_formats(tiny_dirs, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["generate", "x", "--target", str(tiny_dirs.target), "--structural-tag", json.dumps(TAG),
              "--json-schema", "{}"])
    assert exited.value.code == 2 and "not allowed with" in capsys.readouterr().err
