"""What every tandem command shares (tandem.cli.options): help that starts without the server stack and shows each
default once, errors that name the flag at fault, and `--prompts SET|FILE` in loadtest as in `tandem bench`."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import pytest

from gateway_harness import ServerThread, tiny_backend
from loadtest.__main__ import main as loadtest_main
from loadtest.config import RunConfig
from loadtest.trace import load as load_trace
from tandem.cli.main import COMMANDS, CommandParser, build_parser, main
from tandem.sessions import MemorySessionStore

HEAVY = ("torch", "transformers", "ray", "grpc", "numpy", "redis")

# `tandem --help`, `python -m tandem --help`, the light commands and their help, in one fresh interpreter; then
# what of the server stack they imported.
LIGHT_COMMANDS = """
import runpy, sys
from tandem.cli.main import build_parser, main

build_parser()
for argv in (["--help"], ["models", "list"], ["models", "--help"], ["generate", "--help"], ["bench", "--help"],
             ["keys", "create", "--help"]):
    try:
        main(argv)
    except SystemExit as exc:
        assert exc.code in (0, None), (argv, exc.code)
sys.argv = ["tandem", "--help"]
try:
    runpy.run_module("tandem", run_name="__main__")
except SystemExit as exc:
    assert exc.code in (0, None), exc.code
print("imported:", sorted({name.split(".")[0] for name in sys.modules} & set(HEAVY)))
"""


def test_help_and_models_list_import_no_server_stack(tmp_path) -> None:
    script = f"HEAVY = {HEAVY!r}\n" + LIGHT_COMMANDS
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=os.environ | {"TANDEM_HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == "imported: []"
    for command in COMMANDS:  # `tandem --help` lists every command with its line of help
        assert re.search(rf"^\s+{command.name}\s+{re.escape(command.help[:30])}", proc.stdout, re.MULTILINE)
    assert "cache: " in proc.stdout  # `tandem models list` ran


# Each command that loads models, given a model path that does not exist: its exit code, and what of the model stack
# it had imported by then (all in one interpreter, so the set only grows).
BAD_MODEL_COMMANDS = """
import sys
from tandem.cli.main import main

for argv in (["generate", "x"], ["bench"], ["serve", "--port", "0"], ["pools", "start", "--name", "p"]):
    code = main(argv + ["--target", sys.argv[1], "--draft", "qwen2.5-coder-0.5b-instruct"])
    print(argv[0], code, sorted({name.split(".")[0] for name in sys.modules} & {"torch", "transformers", "ray"}))
"""


def test_a_model_path_no_load_could_use_fails_before_the_model_stack_is_imported(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-c", BAD_MODEL_COMMANDS, str(tmp_path / "nope")], capture_output=True,
                          text=True, timeout=120, env=os.environ | {"TANDEM_HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == ["generate 2 []", "bench 2 []", "serve 2 []", "pools 2 []"]
    errors = proc.stderr.splitlines()
    assert len(errors) == 4 and all(line.startswith(f"error: model '{tmp_path / 'nope'}': no such file or directory")
                                    for line in errors), errors


def _every_parser() -> list[tuple[str, argparse.ArgumentParser]]:
    """(`tandem ...`, parser) for `tandem` and every command and sub-command under it."""
    found, pending = [], [("tandem", build_parser())]
    while pending:
        name, parser = pending.pop()
        found.append((name, parser))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for command in list(action.choices):
                    if hasattr(action, "load"):
                        action.load(command)  # the command's own parser, in place of the placeholder
                pending += [(f"{name} {command}", sub) for command, sub in action.choices.items()]
    return found


def test_every_parser_shows_each_default_once() -> None:
    parsers = _every_parser()
    assert {name.split()[1] for name, _ in parsers if " " in name} == {command.name for command in COMMANDS}
    for name, parser in parsers:
        assert isinstance(parser, CommandParser), name
        text = " ".join(parser.format_help().split())
        assert not re.search(r"\(default:[^()]*\)\s*\(default", text), name
        for action in parser._actions:
            default = action.default
            if (not action.option_strings or default in (None, argparse.SUPPRESS) or default is False
                    or default in ("", [], ())):
                continue  # switches, options unset by default, --help and positionals have no default to show
            formatter = parser._get_formatter()
            formatter.add_argument(action)
            shown = " ".join(formatter.format_help().split())
            assert "default" in shown, (name, action.option_strings, shown)


@pytest.mark.parametrize(("argv", "message"), [
    (["serve", "--port", "70000"], "error: --port: must be between 0 and 65535, got 70000"),
    (["serve", "--grace", "-1"], "error: --grace: must be non-negative, got -1"),
    (["serve", "--stall-timeout", "0"], "error: --stall-timeout: must be positive, got 0"),
    (["serve", "--http-port", "-2"], "error: --http-port: must be between -1 (off) and 65535"),
    (["serve", "--in-process", "--dtype", "int8"], "error: --dtype: unknown dtype 'int8' (use auto, bf16, "),
    (["serve", "--device", "mps"], "error: --device: unknown device 'mps' (use auto, cpu, cuda or cuda:N)"),
    (["serve", "--no-spec", "--fixed-k", "3"], "error: --fixed-k: nothing is drafted with --no-spec"),
    (["bench", "--max-tokens", "0"], "error: --max-tokens: must be at least 1, got 0"),
    (["pools", "start", "--name", "p", "--batch-window-ms", "-1"], "error: --batch-window-ms: must be non-negative"),
    # a field that no flag of `tandem serve` sets keeps its name
    (["serve", "--canary-arms", '[{"name": "a", "weight": 50}]'], "error: weights: must sum to 100, got 50"),
    (["serve", "--canary-arms", "notjson"], "error: --canary-arms: not valid JSON"),  # the arms it sets: the flag
])
def test_errors_name_the_flag(argv: list[str], message: str, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and "Traceback" not in err, err


def test_keys_error_names_the_flag(tmp_path, capsys) -> None:
    assert main(["keys", "create", "--tenant", "a:b", "--file", str(tmp_path / "keys.jsonl")]) == 2
    assert capsys.readouterr().err.startswith("error: --tenant: 'a:b' is not a valid name")
    assert not (tmp_path / "keys.jsonl").exists()


# --- loadtest --prompts SET|FILE --------------------------------------------------------------------------------


def test_loadtest_prompts_file_rows(tmp_path) -> None:
    rows = [{"prompt": "def fib(n):"}, {"messages": [{"role": "user", "content": "hi"}]},
            {"id": "s", "kind": "code", "length": "short", "prompt": "x = "},
            {"id": "l", "kind": "code", "length": "long", "prompt": "y = "}]
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = RunConfig(address="127.0.0.1:1", requests=1, prompts=str(path), lengths=("short", "medium"))
    prompts = config.load_prompts()
    assert [(p.id, p.kind) for p in prompts] == [("mine-1", "code"), ("mine-2", "chat"), ("s", "code")]
    assert prompts[0].request_input() == {"prompt": "def fib(n):"} and prompts[1].messages == (("user", "hi"),)
    assert len(RunConfig(address="127.0.0.1:1", requests=1, prompts="chat").load_prompts()) > 0
    with pytest.raises(ValueError, match="prompts: must be one of code, chat, mixed or a JSONL file"):
        RunConfig(address="127.0.0.1:1", requests=1, prompts="nope")


@pytest.mark.parametrize(("line", "message"), [
    ("not json", "error: --prompts: bad.jsonl:1: not JSON"),
    ('{"text": "x"}', 'error: --prompts: bad.jsonl:1: needs a "prompt"'),
])
def test_loadtest_bad_prompts_file_is_a_usage_error(tmp_path, capsys, line: str, message: str) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(line + "\n")
    code = loadtest_main(["--address", "127.0.0.1:9", "--requests", "1", "--prompts", str(bad),
                          "--out", str(tmp_path / "out")])
    assert code == 2 and capsys.readouterr().err.startswith(message)
    assert loadtest_main(["--address", "127.0.0.1:9", "--requests", "0", "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith("error: --requests: must be at least 1")


def test_loadtest_runs_the_prompts_of_a_file(tiny_models, tmp_path) -> None:
    target, draft, _ = tiny_models
    prompts = tmp_path / "two.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n" + json.dumps({"prompt": "class A:"}) + "\n")
    server = ServerThread(tiny_backend(target, draft), sessions=MemorySessionStore())
    try:
        code = loadtest_main(["--address", server.address, "--requests", "3", "--max-tokens", "4", "--ignore-eos",
                              "--warmup", "0", "--prompts", str(prompts), "--out", str(tmp_path / "out")])
    finally:
        server.stop()
    assert code == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["completed"] == 3 and results["total_output_tokens"] == 12
    sent = {request.prompt_id for request in load_trace(tmp_path / "out" / "trace.jsonl").requests}
    assert sent == {"two-1", "two-2"} and load_trace(tmp_path / "out" / "trace.jsonl").config["prompts"] == str(prompts)
