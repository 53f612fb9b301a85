"""python -m loadtest: one load level, a sweep, or plots of a finished sweep.

    python -m loadtest --address 127.0.0.1:50051 --rate 2 --requests 100 --speculation auto --out DIR
    python -m loadtest --backend openai --url http://127.0.0.1:8000 --rate 2 --requests 100 --out DIR
    python -m loadtest sweep --address 127.0.0.1:50051 --rates 0.5 1 2 --requests 50 --out DIR
    python -m loadtest plot DIR/sweep.json
    python -m loadtest bound DIR/sweep.json   # the analytic bound per level, from the server's measured costs
    python -m loadtest report DIR/sweep.json  # markdown tables: runs, AUTO/OFF with the targets, the bound
    python -m loadtest rebuild DIR/sweep.json # recompute every results.json and sweep.json from the traces

Exit status: 0 done, 1 the server could not be reached or the warm-up failed, 2 bad arguments (`error: --flag: ...`),
130 interrupted (Ctrl-C; a run writes what it had recorded, marked "interrupted" in its config).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from loadtest.arrivals import parse_rate
from loadtest.client_run import ServerUnreachable, WarmupFailed
from loadtest.config import BACKENDS, MODES, TOKEN_COUNTS, RunConfig
from loadtest.metrics import parse_slos
from loadtest.prompts import LENGTHS, SETS, Prompt
from tandem.cli.options import DefaultsHelpFormatter, add_prompts_option, flag_names, name_flags

# Options copied as they are from the command line into RunConfig (the rest are converted).
CONFIG_ARGS = ("address", "backend", "url", "openai_token_counts", "allow_remote", "requests", "burstiness",
               "max_concurrency", "seed", "duration", "grace", "timeout", "warmup", "max_k", "priority", "prompts",
               "max_tokens", "temperature", "ignore_eos", "sessions", "connect_timeout", "tls", "ca", "client_cert",
               "client_key", "api_key")


T = TypeVar("T")


class UsageError(ValueError):
    pass


def _positive_rate(text: str) -> float:
    try:
        return parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=BACKENDS, default="grpc",
                        help="grpc (--address) or openai: OpenAI's HTTP API streamed over SSE (--url)")
    parser.add_argument("--address", default="", help="grpc: HOST:PORT of a tandem gateway (loopback only)")
    parser.add_argument("--url", default="", help="openai: the server's base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--openai-token-counts", choices=TOKEN_COUNTS, default="token_ids",
                        help="openai: count a chunk's tokens from the token ids the requests ask for (vLLM's "
                             "return_token_ids; exact), from logprobs (exact, the server computes them), or one per "
                             "chunk (vLLM's bench assumption; nothing extra asked)")
    parser.add_argument("--allow-remote", action="store_true", help="allow a non-loopback address")
    parser.add_argument("--tls", action="store_true", help="grpc: connect over TLS (openai: give an https:// --url)")
    parser.add_argument("--ca", default=None, metavar="FILE",
                        help="PEM CA that signed the server's certificate (default: the system's trust store)")
    parser.add_argument("--client-cert", default=None, metavar="FILE",
                        help="mutual TLS: this client's PEM certificate (chain), with --client-key")
    parser.add_argument("--client-key", default=None, metavar="FILE", help="mutual TLS: its PEM private key")
    parser.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"),
                        help="sent as `authorization: Bearer <key>` (default: $TANDEM_API_KEY)")
    parser.add_argument("--requests", type=int, required=True, help="measured requests per run")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (1.0: Poisson)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="rate mode: cap on requests in flight")
    parser.add_argument("--seed", type=int, default=0, help="seeds the arrival gaps, the prompt order and sampling")
    parser.add_argument("--duration", type=float, default=None, help="stop issuing requests after S seconds")
    parser.add_argument("--grace", type=float, default=10.0, help="cancel what is in flight at duration + grace")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request deadline in seconds")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up requests, excluded from the metrics")
    parser.add_argument("--max-k", type=int, default=None, help="cap on draft tokens per round")
    parser.add_argument("--priority", type=int, default=0,
                        help="every request's priority (lower runs first): a second run at a higher value is "
                             "background load beside this one")
    add_prompts_option(parser, SETS, "mixed")
    parser.add_argument("--lengths", nargs="+", choices=LENGTHS, default=list(LENGTHS),
                        help="the prompt lengths to draw from (a file's rows without a length are always drawn)")
    parser.add_argument("--max-tokens", type=int, default=128, help="most tokens per request")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    parser.add_argument("--ignore-eos", action="store_true", help="always generate max-tokens tokens")
    parser.add_argument("--sessions", type=int, default=0, help="distinct session ids (0: one per request)")
    parser.add_argument("--connect-timeout", type=float, default=10.0,
                        help="seconds to wait for the server to answer and (grpc) to turn ready, its models "
                             "loaded, before giving up")
    parser.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS",
                        help="SLOs in milliseconds, e.g. ttft:500 tpot:100 e2el:5000")


def run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtest", description="Run one load level against tandem.",
                                     formatter_class=DefaultsHelpFormatter)
    add_common(parser)
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--rate", type=_positive_rate, default=None, help="requests per second, or inf (default)")
    load.add_argument("--concurrency", type=int, default=None, help="fixed number of requests in flight")
    parser.add_argument("--speculation", choices=MODES, default="auto", help="the requests' speculation mode")
    return parser


def sweep_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtest sweep",
                                     description="Run several load levels, each with speculation AUTO and OFF.",
                                     formatter_class=DefaultsHelpFormatter)
    add_common(parser)
    load = parser.add_mutually_exclusive_group(required=True)
    load.add_argument("--rates", type=_positive_rate, nargs="+", help="request rates (req/s; inf allowed)")
    load.add_argument("--concurrencies", type=int, nargs="+", help="fixed concurrencies")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="the speculation modes each level runs in")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each level and mode, the order reversed every other time; results pooled")
    parser.add_argument("--no-plots", action="store_true", help="write no PNG plots")
    return parser


def plot_parser() -> argparse.ArgumentParser:
    parser = _sweep_file_parser("plot", "Plot a finished sweep.")
    parser.add_argument("--out", type=Path, default=None, help="where the PNGs go (default: next to sweep.json)")
    return parser


def _sweep_file_parser(command: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m loadtest {command}", description=description,
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("sweep", type=Path, help="a sweep.json")
    return parser


def config_from(args: argparse.Namespace, **load) -> RunConfig:
    try:
        slos = parse_slos(args.goodput)
    except ValueError as exc:
        raise UsageError(f"goodput: {exc}") from None
    try:
        return RunConfig(**{name: getattr(args, name) for name in CONFIG_ARGS}, lengths=tuple(args.lengths),
                         goodput=slos, **load)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def usage_checked(check: Callable[..., T], *args: Any) -> T:
    """check(*args), its ValueError a usage error: for checks that run before anything is sent."""
    try:
        return check(*args)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def out_dir(out: Path) -> None:
    """--out created now, so that a path no run could write to is a usage error before the run, not after it."""
    from loadtest.run import make_out_dir

    usage_checked(make_out_dir, out)


def prompts_of(config: RunConfig) -> list[Prompt]:
    """--prompts read now, so that a bad file is a usage error before any request is sent."""
    try:
        return config.load_prompts()
    except ValueError as exc:
        raise UsageError(str(exc)) from None


PARSERS = {
    "run": run_parser, "sweep": sweep_parser, "plot": plot_parser,
    "bound": lambda: _sweep_file_parser("bound", "The analytic bound per level, from the server's measured costs."),
    "report": lambda: _sweep_file_parser("report", "Markdown tables: the runs, AUTO/OFF with the targets, the bound."),
    "rebuild": lambda: _sweep_file_parser("rebuild", "Recompute every results.json and sweep.json from the traces."),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and argv[0] in PARSERS.keys() - {"run"} else "run"
    parser = PARSERS[command]()
    args = parser.parse_args(argv)
    try:
        if command in ("plot", "bound", "report", "rebuild"):
            return {"plot": _plot, "bound": _bound, "report": _report, "rebuild": _rebuild}[command](args)
        if command == "sweep":
            base = config_from(args)
            prompts = prompts_of(base)
            from loadtest.sweep import plan_sweep, run_sweep

            usage_checked(plan_sweep, base, args.rates, args.concurrencies, args.repeats)
            out_dir(args.out)
            body = run_sweep(base, args.out, rates=args.rates, concurrencies=args.concurrencies,
                             modes=tuple(dict.fromkeys(args.modes)), prompts=prompts, plots=not args.no_plots,
                             repeats=args.repeats)
            print(f"wrote {args.out / 'sweep.json'}" + (f" and {', '.join(body['plots'])}" if "plots" in body else ""))
            return 0
        config = config_from(args, rate=args.rate, concurrency=args.concurrency, speculation=args.speculation)
        prompts = prompts_of(config)
        from loadtest.run import run_to_dir, summary

        out_dir(args.out)
        results = run_to_dir(config, args.out, prompts)
        print(summary(results))
        print(f"wrote {args.out / 'results.json'}")
        return 0
    except UsageError as exc:
        print(f"error: {name_flags(str(exc), flag_names([parser]))}", file=sys.stderr)
        return 2
    except WarmupFailed as exc:
        print(f"error: warmup: {exc}", file=sys.stderr)
        return 1
    except ServerUnreachable as exc:
        print(f"error: {'--url' if args.backend == 'openai' else '--address'}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the run's records so far are written (loadtest.run.run_to_dir)
        print("interrupted", file=sys.stderr)
        return 130


def _plot(args: argparse.Namespace) -> int:
    import json

    from loadtest.report.plots import plot_sweep

    out = args.out or args.sweep.parent
    paths = plot_sweep(json.loads(args.sweep.read_text()), out)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _rebuild(args: argparse.Namespace) -> int:
    from loadtest.sweep import rebuild

    body = rebuild(args.sweep.parent)
    print(f"wrote {args.sweep}" + (f" and {', '.join(body['plots'])}" if "plots" in body else ""))
    return 0


def _report(args: argparse.Namespace) -> int:
    import json

    from loadtest.report.tables import markdown

    print(markdown(json.loads(args.sweep.read_text())))
    return 0


def _bound(args: argparse.Namespace) -> int:
    import json

    from tandem.bench.bound import sweep_bound

    print(json.dumps(sweep_bound(json.loads(args.sweep.read_text())), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
