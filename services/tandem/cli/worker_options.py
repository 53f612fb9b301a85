"""The flags of the commands that start Ray workers (`tandem serve` and `tandem pools start`): how many workers of each
pool and where they land, the Ray token that admits them to the cluster, and the port each serves /metrics on.
"""

from __future__ import annotations

import argparse
import os

from tandem.errors import InvalidArgument


def add_pool_options(parser: argparse.ArgumentParser) -> None:
    """How many workers of each pool, and where they land: `tandem serve` and `tandem pools start`."""
    parser.add_argument("--draft-workers", type=int, default=1, help="draft-worker actors (default: %(default)s)")
    parser.add_argument("--target-replicas", type=int, default=1, help="target replicas (default: %(default)s)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per target replica")
    parser.add_argument("--draft-gpus", type=float, default=0.0, help="GPUs per draft worker (default: 0)")
    parser.add_argument("--target-gpus", type=float, default=0.0, help="GPUs per target rank (default: 0)")
    parser.add_argument("--draft-resources", default=None, metavar="JSON",
                        help='custom Ray resources per draft worker, e.g. \'{"draft_pool": 1}\' (a worker group\'s)')
    parser.add_argument("--target-resources", default=None, metavar="JSON",
                        help='custom Ray resources per target rank, e.g. \'{"target_pool": 1}\'')


def add_ray_token_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ray-token-file", default=None, metavar="FILE",
                        help="Ray token authentication: the cluster's token (default: $RAY_AUTH_TOKEN or "
                             "$RAY_AUTH_TOKEN_PATH, which Ray reads itself; a local cluster gets a random token)")


def add_worker_metrics_option(parser: argparse.ArgumentParser) -> None:
    """--worker-metrics-port: `tandem serve` and `tandem pools start`."""
    from tandem.telemetry.worker import DEFAULT_WORKER_METRICS_PORT, METRICS_PORT_ENV

    parser.add_argument("--worker-metrics-port", type=int, default=None,
                        help=f"first /metrics port of each Ray worker (default: ${METRICS_PORT_ENV} or "
                        f"{DEFAULT_WORKER_METRICS_PORT}; taken: the next free one; 0: a free port; -1: off)")
    parser.set_defaults(no_metrics=False)  # `tandem serve --no-metrics` turns the workers' off too


def worker_metrics_port(args: argparse.Namespace) -> int:
    """The port Ray workers serve /metrics on (-1: off), handed to them as $TANDEM_WORKER_METRICS_PORT."""
    from tandem.telemetry.worker import DEFAULT_WORKER_METRICS_PORT, METRICS_PORT_ENV

    if args.no_metrics:
        return -1
    port = args.worker_metrics_port
    if port is None:
        port = int(os.environ.get(METRICS_PORT_ENV) or DEFAULT_WORKER_METRICS_PORT)
    if not -1 <= port <= 65535:
        raise InvalidArgument(f"worker_metrics_port: must be between -1 (off) and 65535, got {port}")
    return port
