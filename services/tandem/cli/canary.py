"""`tandem canary status|set|promote|rollback`: the shared canary state in Redis, as every gateway replica sees it.

    tandem canary status [--json [PATH]]
    tandem canary set stable=90 canary=10                # live weights (percent, summing to 100)
    tandem canary set --arms '[{"name": "stable", "weight": 95}, {"name": "canary", "draftModel": "d", "weight": 5}]'
    tandem canary set --threshold min_sessions=100 --steps 5 25 50 100 --manual
    tandem canary promote [ARM] [--to PERCENT]           # one step of the schedule, or to PERCENT
    tandem canary rollback [ARM]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from tandem.cli.options import add_json_option, field_as_option, wants_text, write_json
from tandem.cli.redis_options import add_redis_options, session_store_url
from tandem.errors import InvalidArgument

ENV_DEPLOYMENT = "TANDEM_CANARY_DEPLOYMENT"
DEFAULT_WINDOW = 2000


def add_canary_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    add_redis_options(common, "Redis holding the canary state (default: $REDIS_URL)")
    common.add_argument("--deployment", default=os.environ.get(ENV_DEPLOYMENT) or "default",
                        help=f"canary deployment name (default: ${ENV_DEPLOYMENT}, else 'default')")
    parser = subparsers.add_parser("canary")  # its help line is in tandem.cli.main.COMMANDS
    commands = parser.add_subparsers(dest="canary_command", metavar="COMMAND", required=True)

    status = commands.add_parser("status", parents=[common], help="arms, weights, per-arm stats, decision log")
    add_json_option(status, "the state, each arm's observations and the last analysis")
    status.add_argument("--log", type=int, default=20, help="decision log entries to show (default: %(default)s)")
    status.add_argument("--generation", type=int, default=None,
                        help="show the observation windows of this generation (default: the current one)")
    status.set_defaults(handler=cmd_status)

    set_ = commands.add_parser("set", parents=[common], help="set weights, register arms, thresholds, steps")
    set_.add_argument("weights", nargs="*", metavar="ARM=PERCENT", help="new weights; arms left out get 0")
    set_.add_argument("--arms", metavar="JSON|@FILE", help="register these arms (a new experiment)")
    set_.add_argument("--baseline", help="with --arms: the baseline arm (default: 'stable', else the first)")
    set_.add_argument("--steps", nargs="+", metavar="PERCENT", help="promotion schedule, e.g. 5 25 50 100")
    set_.add_argument("--threshold", action="append", default=[], metavar="NAME=VALUE",
                      help="analysis threshold (repeatable), e.g. --threshold min_sessions=100")
    mode = set_.add_mutually_exclusive_group()
    mode.add_argument("--auto", dest="auto", action="store_true", default=None, help="automatic decisions on")
    mode.add_argument("--manual", dest="auto", action="store_false", default=None, help="automatic decisions off")
    set_.add_argument("--reason", default="", help="noted in the decision log")
    set_.set_defaults(handler=cmd_set)

    promote = commands.add_parser("promote", parents=[common], help="move a candidate up one step (or --to)")
    promote.add_argument("arm", nargs="?", help="candidate arm (default: the only one with traffic)")
    promote.add_argument("--to", type=float, help="percent of sessions for the arm (100: full promotion)")
    promote.add_argument("--reason", default="", help="noted in the decision log")
    promote.set_defaults(handler=cmd_promote)

    rollback = commands.add_parser("rollback", parents=[common], help="send a candidate's sessions to the baseline")
    rollback.add_argument("arm", nargs="?", help="candidate arm (default: the only one with traffic)")
    rollback.add_argument("--reason", default="", help="noted in the decision log")
    rollback.set_defaults(handler=cmd_rollback)
    return parser


CLI_REDIS_TIMEOUT_S = 10.0


def _store(args: argparse.Namespace):
    from tandem.canary.store import open_canary_store

    if not args.redis_url:
        raise InvalidArgument("redis_url: give the Redis the gateways use (or set REDIS_URL)")
    if not args.deployment:
        raise InvalidArgument("deployment: must be a non-empty name")
    # An operator's command may wait on a loaded Redis; a gateway's store keeps its short timeout (serving must not).
    return open_canary_store(session_store_url(args), socket_timeout_s=CLI_REDIS_TIMEOUT_S)


def _require(state, deployment: str):
    if state is None:
        raise InvalidArgument(f"deployment: no canary registered for {deployment!r}; register arms with "
                              "`tandem canary set --arms JSON` or start gateways with TANDEM_CANARY_ARMS")
    return state


def parse_weights(items: list[str]) -> dict[str, float]:
    weights: dict[str, float] = {}
    for item in items:
        name, sep, text = item.partition("=")
        try:
            value = float(text)
        except ValueError:
            value = None
        if not sep or not name or value is None:
            raise InvalidArgument(f"weights: expected ARM=PERCENT, got {item!r}")
        if name in weights:
            raise InvalidArgument(f"weights: {name!r} given twice")
        weights[name] = value
    return weights


def _arms_text(value: str) -> str:
    if value.startswith("@"):
        try:
            return Path(value[1:]).read_text()
        except OSError as exc:
            raise InvalidArgument(f"arms: cannot read {value[1:]}: {exc.strerror}") from exc
    return value


def _reasons(args: argparse.Namespace) -> list[str]:
    return [args.reason] if args.reason else []


def _weights_text(weights: dict) -> str:
    return " ".join(f"{name}={weight:g}" for name, weight in weights.items()) or "-"


def _report(records: list, deployment: str) -> None:
    for record in records:
        print(f"canary {deployment}: {record.action} {record.arm or '-'} ({record.code}): "
              f"{_weights_text(record.weights_before)} -> {_weights_text(record.weights_after)}"
              + (f"; {'; '.join(record.reasons)}" if record.reasons else ""))


def _change(args: argparse.Namespace, change, replace_invalid: bool = False) -> int:
    """Run `change(state) -> (state, [records])` in one transaction and print what it decided."""
    store = _store(args)
    made: list = []

    def apply(current):
        made.clear()
        new, records = change(current)
        made.extend(records)
        return new

    try:
        store.update(args.deployment, apply, replace_invalid=replace_invalid)
    finally:
        store.close()
    _report(made, args.deployment)
    return 0


def cmd_set(args: argparse.Namespace) -> int:
    from tandem.canary.arms import parse_arms
    from tandem.canary.state import new_state

    weights = parse_weights(args.weights)
    arms = parse_arms(_arms_text(args.arms)) if args.arms else None
    from tandem.canary.config import parse_steps

    steps = parse_steps(args.steps) if args.steps else None
    if not (weights or arms or steps or args.threshold or args.auto is not None):
        raise InvalidArgument("weights: give ARM=PERCENT pairs, --arms, --steps, --threshold, --auto or --manual")
    if args.baseline and not arms:
        raise InvalidArgument("baseline: only with --arms (a new experiment)")
    reasons = _reasons(args)

    def change(state):
        records = []
        if arms is not None:
            state = new_state(args.deployment, arms, baseline=args.baseline, source="cli", previous=state,
                              thresholds=state.thresholds if state is not None else None)
            records.append(state.log[-1])
        state = _require(state, args.deployment)
        if steps is not None or args.threshold or args.auto is not None:
            thresholds = state.thresholds.with_text(args.threshold) if args.threshold else None
            state, record = state.configured(thresholds=thresholds, auto=args.auto, steps=steps)
            records.append(record)
        if weights:
            state, record = state.with_weights(weights, reasons=reasons)
            records.append(record)
        return state, records

    return _change(args, change, replace_invalid=arms is not None)


def cmd_promote(args: argparse.Namespace) -> int:
    def change(state):
        new, record = _require(state, args.deployment).promote(args.arm, to=args.to, reasons=_reasons(args))
        return new, [record]

    return _change(args, change)


def cmd_rollback(args: argparse.Namespace) -> int:
    def change(state):
        new, record = _require(state, args.deployment).rollback(args.arm, reasons=_reasons(args))
        return new, [record]

    return _change(args, change)


def _fmt(value, scale: float = 1.0, digits: int = 3) -> str:
    return "-" if value is None else f"{value * scale:.{digits}g}"


def cmd_status(args: argparse.Namespace) -> int:
    from tandem.canary.observations import count_text, summarize

    store = _store(args)
    try:
        state = _require(store.load(args.deployment), args.deployment)
        generation = state.generation if args.generation is None else args.generation
        if not 1 <= generation <= state.generation:
            raise InvalidArgument(f"generation: must be between 1 and {state.generation}, got {generation}")
        share = state.thresholds.max_tenant_share  # as the analysis sees the windows: each tenant capped
        summaries = {arm.name: summarize(store.outcomes(args.deployment, generation, arm.name, DEFAULT_WINDOW), share)
                     for arm in state.arms}
        evaluation = store.evaluation(args.deployment)
    finally:
        store.close()
    write_json(args.json, {"state": state.to_dict() | {"log": [r.to_dict() for r in state.log[-args.log:]]},
                           "generation": generation, "summaries": {name: s.to_dict() for name, s in summaries.items()},
                           "evaluation": evaluation})
    if not wants_text(args):
        return 0
    print(f"deployment {state.deployment}  status {state.status}  auto {'on' if state.auto else 'off'}  "
          f"generation {state.generation}  baseline {state.baseline}  steps {','.join(f'{s:g}' for s in state.steps)}")
    print(f"observations of generation {generation} (the newest {DEFAULT_WINDOW} per arm; sessions and rates with "
          f"each tenant capped at {share:g} of an arm's weight):")
    header = ("ARM", "WEIGHT", "TARGET", "DRAFT", "REQUESTS", "SESSIONS", "ACCEPT", "TPOT_P50_MS", "TPOT_P99_MS",
              "ERRORS", "GREEDY", "TENANTS")
    rows = [header]
    for arm in state.arms:
        s = summaries[arm.name]
        rows.append((arm.name, f"{arm.weight:g}", arm.target or "(default)", arm.draft or "(default)",
                     str(s.observed), count_text(s.sessions), _fmt(s.acceptance), _fmt(s.tpot_p50, 1e3),
                     _fmt(s.tpot_p99, 1e3), f"{s.error_rate:.3f}",
                     f"{count_text(s.greedy_checks - s.greedy_mismatches)}/{count_text(s.greedy_checks)}",
                     str(s.tenants)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    if evaluation and evaluation.get("verdicts"):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(evaluation.get("at", 0)))
        print(f"last analysis (generation {evaluation.get('generation')}, {when}, by {evaluation.get('by')}):")
        for name, verdict in evaluation["verdicts"].items():
            print(f"  {name}: {verdict['action']} ({verdict['code']}): {'; '.join(verdict['reasons'])}")
    print("decisions:")
    for record in state.log[-args.log:]:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.at))
        print(f"  {when}  {record.source:<6}  {record.action:<8}  {record.arm or '-'}  ({record.code})  "
              f"{_weights_text(record.weights_before)} -> {_weights_text(record.weights_after)}"
              + (f"  {'; '.join(record.reasons)}" if record.reasons else ""))
    return 0


def add_serve_canary_options(parser: argparse.ArgumentParser) -> None:
    """`tandem serve` flags for the in-gateway canary (each defaults to its environment variable)."""
    group = parser.add_argument_group("canary", "split sessions across arms; see `tandem canary --help`")
    group.add_argument("--canary-arms", default=os.environ.get("TANDEM_CANARY_ARMS") or None, metavar="JSON",
                       help='arms, e.g. \'[{"name": "stable", "weight": 95}, {"name": "canary", "draftModel": '
                            '"my-draft", "weight": 5}]\' (default: $TANDEM_CANARY_ARMS; unset: no canary)')
    group.add_argument("--canary-deployment", default=None,
                       help=f"name of the shared canary state (default: ${ENV_DEPLOYMENT}, else 'default')")
    group.add_argument("--canary-threshold", action="append", default=[], metavar="NAME=VALUE",
                       help="analysis threshold for a newly registered canary (repeatable), e.g. min_sessions=100")
    group.add_argument("--canary-steps", nargs="+", default=None, metavar="PERCENT",
                       help="promotion schedule of a newly registered canary (default: 5 25 50 100)")
    group.add_argument("--canary-greedy-check-rate", type=float, default=None,
                       help="share of greedy sessions of a draft canary re-run as plain decoding (default: 0.05)")
    group.add_argument("--canary-decide-interval", type=float, default=None,
                       help="seconds between analyses (default: 10)")
    group.add_argument("--canary-secret-file", default=None, metavar="PATH",
                       help="the secret that keys session-to-arm assignment, the same file in every gateway replica "
                            "(e.g. `openssl rand -hex 32 > PATH`; default: $TANDEM_CANARY_SECRET_FILE, else "
                            "$TANDEM_CANARY_SECRET, else a random one per process: replicas then disagree)")


def serve_canary_options(args: argparse.Namespace):
    """CanaryOptions from the flags above and the environment; None when no arms are configured."""
    import dataclasses

    from tandem.canary.arms import parse_arms
    from tandem.canary.config import options_from_env, parse_steps
    from tandem.canary.secret import secret_from_file

    try:
        arms = parse_arms(args.canary_arms) if args.canary_arms else None
    except InvalidArgument as exc:  # "arms: ..." names the flag that set them
        raise InvalidArgument(field_as_option(str(exc), "arms", "canary_arms")) from None
    options = options_from_env(
        arms=arms, deployment=args.canary_deployment,
        steps=parse_steps(args.canary_steps) if args.canary_steps else None,
        greedy_check_rate=args.canary_greedy_check_rate, decide_interval_s=args.canary_decide_interval,
        secret=secret_from_file(args.canary_secret_file) if args.canary_secret_file else None)
    if options is not None and args.canary_threshold:
        options = dataclasses.replace(options, thresholds=options.thresholds.with_text(args.canary_threshold))
    return options
