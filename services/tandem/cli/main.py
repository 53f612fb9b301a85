"""The `tandem` command line: one sub-command per module of tandem.cli, each imported only when it runs.

`tandem --help` lists the commands from COMMANDS alone, and `tandem models list` imports the models command and
nothing of the server stack: neither waits for torch, Ray or gRPC to import. Every parser shows its defaults in
help (CommandParser), and an error a handler raises about a field names the flag that sets it (`--port`, not
`port`).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

from tandem import __version__
from tandem.cli.options import DefaultsHelpFormatter, flag_names, name_flags
from tandem.errors import InvalidArgument, TandemError


@dataclass(frozen=True, slots=True)
class Command:
    name: str
    module: str  # tandem.cli.<module>
    adder: str  # the module's function that adds the command's parser to the sub-command action
    help: str  # its line in `tandem --help`, and the description atop `tandem <name> --help`
    extra: str = "server"  # the install it needs: pyproject.toml's extra of that name
    runs_models: bool = False  # loads models in this process or in a local Ray's workers (TANDEM_PRELOAD applies)


COMMANDS = (
    Command("models", "models", "add_models_parser", "pull, list and make models"),
    Command("generate", "generate", "add_generate_parser", "generate text for one prompt", runs_models=True),
    Command("bench", "bench", "add_bench_parser", "benchmark plain, HF assisted and tandem decoding",
            runs_models=True),
    Command("serve", "serve", "add_serve_parser",
            "serve the gRPC and OpenAI HTTP APIs: gateway, Ray draft and target workers, Redis", runs_models=True),
    Command("pools", "pools", "add_pools_parser", "shared draft and target worker pools on a Ray cluster",
            runs_models=True),
    Command("gateway", "gateway", "add_gateway_parser",
            "serve the gRPC and OpenAI HTTP APIs over shared pools (`tandem pools start`)", extra="gateway"),
    Command("canary", "canary", "add_canary_parser", "show and steer the canary arms shared by the gateways"),
    Command("keys", "keys", "add_keys_parser", "manage the API keys a gateway accepts (--api-keys)"),
)


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser whose help shows every default. Sub-command actions make their parsers of the class of the
    parser they belong to, so every level below `tandem` (`tandem pools start`, ...) is one too."""

    def __init__(self, *args: Any, formatter_class: type[argparse.HelpFormatter] = DefaultsHelpFormatter,
                 **kwargs: Any) -> None:
        super().__init__(*args, formatter_class=formatter_class, **kwargs)


class LazyCommands(argparse._SubParsersAction):
    """The `tandem` sub-commands: each starts as a placeholder that only lists the command, and is replaced by the
    command's real parser (its module imported, its adder called) once the command line names it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._commands: dict[str, Command] = {}
        self._loaded: set[str] = set()

    def add_placeholder(self, command: Command) -> None:
        self._commands[command.name] = command
        self.add_parser(command.name, help=command.help, add_help=False)

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        command = self._commands.get(name)
        if command is not None:  # the command's help is stated once, in COMMANDS
            kwargs.setdefault("help", command.help)
            kwargs.setdefault("description", command.help)
        return super().add_parser(name, **kwargs)

    def load(self, name: str) -> None:
        """Replace the placeholder of `name` with the command's parser, keeping its place in the listing."""
        command = self._commands.get(name)
        if command is None or name in self._loaded:
            return
        self._loaded.add(name)
        del self._name_parser_map[name]
        place = next(i for i, choice in enumerate(self._choices_actions) if choice.dest == name)
        del self._choices_actions[place]
        try:
            adder = getattr(importlib.import_module(f"tandem.cli.{command.module}"), command.adder)
        except ModuleNotFoundError as exc:
            if exc.name is None or exc.name.split(".")[0] == "tandem":  # our own bug, not a missing dependency
                raise
            self._add_missing_stack_parser(command, exc)
        else:
            adder(self)
        self._choices_actions.insert(place, self._choices_actions.pop())

    def _add_missing_stack_parser(self, command: Command, exc: ModuleNotFoundError) -> None:
        """On the client install (no torch, Ray, ...): a parser that takes any arguments and says what to install."""
        parser = self.add_parser(command.name, help=f"(needs {install(command.extra)})", add_help=False)
        parser.add_argument("rest", nargs=argparse.REMAINDER)

        def refuse(args: argparse.Namespace) -> int:
            raise TandemError(f"tandem {command.name}: {needs_stack(exc, command.extra)}")

        parser.set_defaults(handler=refuse, missing_stack=True)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: list[str],
                 option_string: str | None = None) -> None:
        self.load(values[0])
        super().__call__(parser, namespace, values, option_string)


def install(extra: str) -> str:
    """From tandem's checkout: PyPI's `tandem` is another project, so no hint names the bare package."""
    return f"pip install '.[{extra}]' in tandem's checkout"


def needs_stack(exc: ModuleNotFoundError, extra: str) -> str:
    return (f"this command needs the {extra} stack, which is not installed (no module {exc.name!r}): "
            f"{install(extra)}")


def build_parser() -> argparse.ArgumentParser:
    """The `tandem` parser; a command's module is imported when a command line names the command."""
    parser = CommandParser(prog="tandem", description="Speculative-decoding LLM serving.")
    parser.add_argument("--version", action="version", version=f"tandem {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    commands = parser.add_subparsers(action=LazyCommands, dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        commands.add_placeholder(command)
    return parser


def command_parsers(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[argparse.ArgumentParser]:
    """The parsers a command line went through, `tandem` first: e.g. tandem, `tandem pools`, `tandem pools start`."""
    chain = [parser]
    while action := next((a for a in chain[-1]._actions if isinstance(a, argparse._SubParsersAction)), None):
        name = getattr(args, action.dest, None)
        if name not in action.choices:
            break
        chain.append(action.choices[name])
    return chain


def _message(exc: TandemError) -> str:
    """An error's message; a tandem error raised in a Ray actor (`tandem pools scale`'s count) arrives as Ray's
    subclass of it, whose text is the remote traceback: its cause's message alone."""
    cause = getattr(exc, "cause", None)
    return str(cause if isinstance(cause, TandemError) else exc)


def run() -> int:
    """The `tandem` command's entry (main() is for callers in a process that goes on, such as tests)."""
    relaunch_preloaded(sys.argv[1:])
    code = main()
    loading = sys.modules.get("tandem.gateway.loading")
    if loading is not None and loading.loader_running():
        # Stopped while its models loaded: the loader thread is still inside torch, and finalizing the interpreter
        # under a thread in an OpenMP region aborts ("terminate called without an active exception", status 134).
        # Everything tandem started is closed by now (servers, Redis, Ray, the spans flushed): leave at once.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def relaunch_preloaded(words: list[str]) -> None:
    """With TANDEM_PRELOAD=1, run this command again, the same process (exec), with tcmalloc and Intel's OpenMP
    runtime preloaded where it runs models on a CPU (core.cpu_runtime.preload_environment says where): torch picks its
    OpenMP runtime and allocator as it loads, so only a process started with them has them. A remote `generate
    --address` runs none."""
    command = next((word for word in words if not word.startswith("-")), None)
    if not any(c.name == command and c.runs_models for c in COMMANDS) or "--address" in words:
        return
    from tandem.core.cpu_runtime import preload_environment

    if (env := preload_environment(os.environ)) is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, sys.orig_argv, env)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # A stub for a command whose stack is missing takes any arguments (argparse.REMAINDER misses leading options).
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "missing_stack", False):
        args = parser.parse_args(argv)  # reports the unknown arguments as argparse always does
    # A time on every line: a server's log is read afterwards, its lines set against a client's or another server's.
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%Y-%m-%d %H:%M:%S")
    try:
        return int(args.handler(args) or 0)
    except InvalidArgument as exc:
        print(f"error: {name_flags(_message(exc), flag_names(command_parsers(parser, args)))}", file=sys.stderr)
        return 2
    except TandemError as exc:
        print(f"error: {_message(exc)}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # e.g. local `tandem generate` (no --address) on the client install
        if exc.name is None or exc.name.split(".")[0] == "tandem":
            raise
        extra = next((c.extra for c in COMMANDS if c.name == args.command), "server")
        print(f"error: {needs_stack(exc, extra)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
