"""`tandem pools start|status|scale|stop`: shared draft and target pools on a Ray cluster (tandem.pools)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import socket
import sys
import time

from tandem.cli.common import add_model_options, announce_compile, engine_config, kv_tokens, pin_model_args
from tandem.cli.options import add_json_option, wants_text, write_json
from tandem.cli.worker_options import (
    add_pool_options,
    add_ray_token_option,
    add_worker_metrics_option,
    worker_metrics_port,
)
from tandem.core.model_options import compiles
from tandem.errors import InvalidArgument, TandemError


def add_ray_address(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ray-address", default=os.environ.get("RAY_ADDRESS"),
                        help="the Ray cluster the pools live on (default: $RAY_ADDRESS)")
    add_ray_token_option(parser)


def connect(args: argparse.Namespace) -> None:
    """Join the Ray cluster: pools outlive this command, so a local throwaway cluster will not do."""

    from tandem import ray_auth
    from tandem.pools.names import NAMESPACE

    if not args.ray_address:
        raise InvalidArgument("ray_address: shared pools live on a running Ray cluster: pass --ray-address or set "
                              "RAY_ADDRESS (e.g. after `ray start --head`)")
    check_reachable(args.ray_address)
    ray_auth.join_cluster(args.ray_address, args.ray_token_file, namespace=NAMESPACE, logging_level=logging.WARNING)


# How long `pools start` and `scale` wait for new workers by default: a cold start that compiles the draft takes
# 12-14 min on a 2-core CPU.
START_TIMEOUT_S = 1800.0
FAILURES_SHOWN = 5  # failed starts `pools status` prints
ADDRESS = re.compile(r"^(?:ray://)?(\[[^\]]+\]|[^:/\[\]]+):(\d+)$")
CONNECT_TIMEOUT_S = 10.0


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Fail at once when nothing listens at a host:port Ray address: ray.init would retry for many minutes."""
    match = ADDRESS.match(address)
    if match is None:  # "auto", a file path, ...: Ray resolves those itself
        return
    host, port = match.group(1).strip("[]"), int(match.group(2))
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        raise TandemError(f"no Ray cluster answers at {address} ({exc}); is `ray start --head` running there, and "
                          "is --ray-address / RAY_ADDRESS right?") from exc


def add_start_timeout(parser: argparse.ArgumentParser, then: str) -> None:
    parser.add_argument("--timeout", type=float, default=START_TIMEOUT_S, metavar="S",
                        help=f"seconds to wait for new workers to load, each change of state reported on stderr "
                             f"(default: {START_TIMEOUT_S:g}); past it {then}")


def _report(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def add_pools_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("pools")
    commands = parser.add_subparsers(dest="pools_command", required=True, metavar="COMMAND")

    start = commands.add_parser("start", help="start named pools as detached Ray actors; returns once ready")
    start.add_argument("--name", required=True, help="the pools' name, for gateways' --pools")
    add_model_options(start)
    add_pool_options(start)
    start.add_argument("--no-spec", action="store_true", help="a target pool only (plain decoding)")
    start.add_argument("--batch-window-ms", type=float, default=2.0,
                       help="how long a worker waits for other gateways' calls to join a forward (default: 2)")
    add_worker_metrics_option(start)
    add_start_timeout(start, "the pools are stopped and the command fails")
    add_ray_address(start)
    start.set_defaults(handler=run_start)

    status = commands.add_parser("status", help="every worker's health, load, sessions, KV tokens, rows per call")
    status.add_argument("--name", default=None, help="one pool (default: every pool on the cluster)")
    add_json_option(status, "the pools' status (one pool's with --name, else {\"pools\": [...]})")
    add_ray_address(status)
    status.set_defaults(handler=run_status)

    scale = commands.add_parser("scale", help="set the number of draft workers or target replicas")
    scale.add_argument("--name", required=True, help="the pools' name")
    scale.add_argument("role", choices=["draft", "target"])
    scale.add_argument("count", type=int)
    add_start_timeout(scale, "the command fails and the workers go on starting (0: return at once)")
    add_ray_address(scale)
    scale.set_defaults(handler=run_scale)

    stop = commands.add_parser("stop", help="stop the pools' workers and manager")
    stop.add_argument("--name", required=True, help="the pools' name")
    add_ray_address(stop)
    stop.set_defaults(handler=run_stop)


def run_start(args: argparse.Namespace) -> int:
    if args.batch_window_ms < 0:
        raise InvalidArgument(f"batch_window_ms: must be non-negative, got {args.batch_window_ms}")
    if args.timeout <= 0:
        raise InvalidArgument(f"--timeout: a start waits for its workers: must be positive, got {args.timeout:g}")
    kv_tokens(args)
    metrics_port = worker_metrics_port(args)
    pin_model_args(args)  # the pools' workers all load the commit a hub id names now
    speculate = not args.no_spec
    config = engine_config(args, speculate)
    announce_compile(args)
    # The pools' stack (Ray, torch), once the arguments are known good.
    from tandem.cli.serve import cluster_options
    from tandem.models.loader import resolve, vocab_size
    from tandem.pools.manager import IMAGE_ENV, PoolSpec
    from tandem.pools.start import start_pools
    from tandem.workers.worker_base import WorkerConfig

    options = cluster_options(args)
    # Pulls a registry model once, before several workers would race for it; each worker verifies what it loads.
    target_vocab = vocab_size(args.target)
    common = {"device": args.device, "dtype": args.dtype, "threads": args.threads, "eager": args.eager,
              "kv_tokens": args.kv_tokens, "batch_window_s": args.batch_window_ms / 1000,
              "retain_tokens": args.retain_tokens, "prefix_cache": args.prefix_cache, "metrics_port": metrics_port}
    target = WorkerConfig(model=args.target, compile=compiles(args.compile, draft=False), **common)
    draft = None
    if speculate and args.draft_workers:
        resolve(args.draft, verify=False)  # likewise
        draft = WorkerConfig(model=args.draft, top_m=config.spec.draft_top_m, confidence=config.spec.stop_confidence,
                             draft_vocab=config.spec.draft_vocab, quantization=args.draft_quantization,
                             compile=compiles(args.compile, draft=True), **common)
    engine = dataclasses.replace(config, spec=dataclasses.replace(config.spec, enabled=draft is not None))
    spec = PoolSpec(name=args.name, target=target, draft=draft, options=options, engine=engine,
                    image=os.environ.get(IMAGE_ENV, ""), target_vocab=target_vocab)
    connect(args)
    described = start_pools(spec, args.timeout, _report)
    print(json.dumps({"started": described["name"], "target": described["target"], "draft": described["draft"],
                      "workers": described["workers"]}))
    return 0


def _managers(args: argparse.Namespace) -> list:
    from tandem.pools.names import all_managers, find_manager

    return [find_manager(args.name)] if args.name else all_managers()


def run_status(args: argparse.Namespace) -> int:
    import ray

    connect(args)
    pools = ray.get([manager.status.remote() for manager in _managers(args)])
    write_json(args.json, pools[0] if args.name else {"pools": pools})
    if not wants_text(args):
        return 0
    if not pools:
        print("no pools on this Ray cluster (`tandem pools start --name NAME ...` starts some)")
    for pool in pools:
        tp = f" (tp {pool['tensor_parallel']})" if pool["tensor_parallel"] > 1 else ""
        print(f"pools {pool['name']}: target {pool['target']}{tp}, draft {pool['draft'] or '-'}, "
              f"rows per verify call {pool['rows_per_verify_call']}")
        for w in pool["workers"]:
            if w["state"] in ("pending", "loading"):
                why = "Ray has placed it on no node yet" if w["state"] == "pending" else "loading its model"
                print(f"  {w['role']:6} {w['name']:10} STARTING ({why})")
                continue
            if not w["healthy"]:
                print(f"  {w['role']:6} {w['name']:10} UNHEALTHY")
                continue
            print(f"  {w['role']:6} {w['name']:10} healthy  {w.get('weights') or '-'}  threads {w['threads']}  "
                  f"sequences {w['sequences']:3}  "
                  f"sessions {w['retained_sessions']:3}  kv {w['kv_tokens_used']}/{w['kv_tokens_capacity']}  "
                  f"rows/forward {w['rows_per_forward']:.2f}  calls/forward {w['calls_per_forward']:.2f}  "
                  f"evicted {w.get('evicted', 0)}")
        for failed in pool["failed_starts"][-FAILURES_SHOWN:]:  # the newest; --json has the last 64
            print(f"  {failed['role']:6} {failed['name']:10} FAILED to start {time.time() - failed['at']:.0f} s ago: "
                  f"{failed['error']}")
    return 0


def run_scale(args: argparse.Namespace) -> int:
    import ray

    if args.timeout < 0:
        raise InvalidArgument(f"--timeout: must be non-negative (0: return at once), got {args.timeout:g}")
    connect(args)
    manager = _managers(args)[0]
    described = ray.get(manager.scale.remote(args.role, args.count))
    starting = described["starting"][args.role]
    if starting and args.timeout:
        from tandem.pools.waiting import wait_ready

        wait_ready(manager, described["name"], starting, args.timeout, _report,
                   on_timeout=f"They go on starting; `tandem pools scale --name {args.name} {args.role} N` with a "
                              f"smaller N stops them")
        described = ray.get(manager.describe.remote())
        have = len(described["workers"][args.role]) + len(described["starting"][args.role])
        if have != args.count:  # another shell's scale overtook this one: its caller must not read success
            raise TandemError(f"pools {described['name']}: {args.role} has {have} workers, not the {args.count} "
                              f"asked for: a later scale (or a worker's death) changed the count while this one "
                              f"waited; `tandem pools status --name {args.name}`")
    print(json.dumps({"scaled": described["name"], "workers": described["workers"],
                      "starting": described["starting"]}))
    return 0


def run_stop(args: argparse.Namespace) -> int:
    from tandem.pools.names import stop_pools

    connect(args)
    stop_pools(_managers(args)[0])
    print(json.dumps({"stopped": args.name}))
    return 0
