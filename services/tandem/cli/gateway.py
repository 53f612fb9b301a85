"""`tandem gateway --pools NAME`: a stateless gRPC gateway over running shared pools (any number of them)."""

from __future__ import annotations

import argparse
import os
import threading

from tandem.cli.pools import add_ray_address, connect
from tandem.cli.redis_options import session_store_url
from tandem.cli.serving import add_gateway_options, gateway_options, serve_gateway
from tandem.errors import InvalidArgument


def add_gateway_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("gateway")
    parser.add_argument("--pools", required=True, metavar="NAME", help="the pools to attach to")
    add_ray_address(parser)
    add_gateway_options(parser)
    parser.add_argument("--draft-timeout", type=float, default=5.0,
                        help="seconds a draft call may take before its rows decode plainly (default: %(default)s)")
    parser.set_defaults(handler=run_gateway)


def run_gateway(args: argparse.Namespace) -> int:
    # A gateway holds no model: transformers' advice that without torch "Models won't be available" is no news to
    # its operator (the gateway install has no torch on purpose), only alarm in its log.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from tandem.pools.names import check_pool_name
    from tandem.telemetry import tracing

    check_pool_name(args.pools, "pools")  # before Ray is joined
    options = gateway_options(args)
    if not args.draft_timeout > 0:  # 0 or less: every draft call late, speculation silently off
        raise InvalidArgument(f"draft_timeout: must be more than 0 seconds, got {args.draft_timeout}")
    session_store_url(args)  # a bad Redis password file or CA fails now, before Ray is joined
    exporters = tracing.setup_from_env("tandem-gateway")
    # Ray is joined on the main thread, before the gateway's SIGTERM handler (see `tandem serve`).
    connect(args)
    from tandem.engines.shared_pools import attach_backend, exit_status  # the engine stack, once a cluster answers
    from tandem.pools import find_manager

    find_manager(args.pools)  # a clear error now rather than a gateway that never turns ready
    stop = threading.Event()

    def load():
        return attach_backend(args.pools, max_batch=args.max_batch, prefill_chunk=args.prefill_chunk,
                              max_prefill_tokens=args.max_prefill_tokens, draft_timeout_s=args.draft_timeout,
                              stop=stop, lanes=args.lanes)

    try:
        return serve_gateway(args, load, options, None, exporters, model=f"pools {args.pools}") or exit_status()
    finally:
        stop.set()
        import ray

        ray.shutdown()  # a gateway's exit leaves the pools' workers running: they are detached actors
