"""`tandem serve`: start Ray workers (or load in-process), Redis session state, and the gRPC gateway."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os

from tandem.cli.common import add_model_options, engine_config, load_models
from tandem.errors import InvalidArgument, TandemError
from tandem.gateway.server import GatewayOptions, serve
from tandem.gateway.servicer import Backend
from tandem.gateway.validate import GatewayLimits
from tandem.local_engine import build_engine


def add_serve_parser(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="serve the gRPC API: gateway, Ray draft and target workers, Redis")
    add_model_options(parser)
    parser.add_argument("--draft-workers", type=int, default=1, help="draft-worker actors (default: %(default)s)")
    parser.add_argument("--target-replicas", type=int, default=1, help="target replicas (default: %(default)s)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per target replica")
    parser.add_argument("--draft-gpus", type=float, default=0.0, help="GPUs per draft worker (default: 0)")
    parser.add_argument("--target-gpus", type=float, default=0.0, help="GPUs per target rank (default: 0)")
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL"),
                        help="session state store (default: $REDIS_URL, else an embedded redis-server)")
    parser.add_argument("--ray-address", default=None, help="join this Ray cluster (default: $RAY_ADDRESS or local)")
    parser.add_argument("--in-process", action="store_true", help="load both models in the gateway, no Ray")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=50051, help="0 picks a free port (default: %(default)s)")
    parser.add_argument("--no-spec", action="store_true", help="serve plain target decoding (no draft model)")
    parser.add_argument("--max-queue", type=int, default=256,
                        help="requests queued or running before RESOURCE_EXHAUSTED (default: %(default)s)")
    parser.add_argument("--max-batch", type=int, default=16, help="sequences per engine step (default: %(default)s)")
    parser.add_argument("--max-tokens-limit", type=int, default=GatewayLimits().max_tokens,
                        help="largest max_tokens a request may ask for (default: %(default)s)")
    parser.add_argument("--max-prompt-tokens", type=int, default=GatewayLimits().max_prompt_tokens,
                        help="longest prompt in tokens (default: %(default)s)")
    parser.add_argument("--grace", type=float, default=30.0,
                        help="seconds in-flight requests may run on after SIGTERM (default: %(default)s)")
    parser.add_argument("--stall-timeout", type=float, default=60.0,
                        help="fail in-flight requests when one engine step runs longer (default: %(default)s)")
    parser.set_defaults(handler=run_serve)


def gateway_options(args: argparse.Namespace) -> GatewayOptions:
    if not 0 <= args.port <= 65535:
        raise InvalidArgument(f"port: must be between 0 and 65535, got {args.port}")
    if args.max_queue < 1:
        raise InvalidArgument(f"max_queue: must be at least 1, got {args.max_queue}")
    if args.grace < 0 or args.stall_timeout <= 0:
        raise InvalidArgument("grace: must be non-negative; stall_timeout: must be positive")
    limits = GatewayLimits(max_tokens=args.max_tokens_limit, max_prompt_tokens=args.max_prompt_tokens)
    return GatewayOptions(host=args.host, port=args.port, limits=limits, max_requests=args.max_queue,
                          stall_timeout=args.stall_timeout, grace=args.grace)


def _cluster_loader(args: argparse.Namespace, config):
    from tandem.cluster import ClusterOptions, start_backend, start_ray

    options = ClusterOptions(draft_workers=args.draft_workers, target_replicas=args.target_replicas,
                             tensor_parallel=args.tp, draft_gpus=args.draft_gpus, target_gpus_per_rank=args.target_gpus,
                             ray_address=args.ray_address, threads=args.threads, device=args.device, dtype=args.dtype)

    # Ray starts here, on the main thread and before the gateway sets its SIGTERM handler: started later from the
    # loading thread, Ray's own handler would take SIGTERM over and abort instead of draining.
    start_ray(options)

    def load() -> Backend:
        return start_backend(args.target, args.draft if config.spec.speculating else None, config, options)

    return load


def _session_store(url: str | None, stack: contextlib.ExitStack):
    from tandem.sessions import EmbeddedRedis, open_session_store

    if not url:
        try:
            redis = stack.enter_context(EmbeddedRedis())
        except RuntimeError as exc:
            logging.getLogger(__name__).warning("no Redis: keeping session state in memory (%s)", exc)
            return open_session_store(None)
        url = redis.url
        print(f"tandem: session state in embedded Redis at {url}", flush=True)
    return open_session_store(url)


def run_serve(args: argparse.Namespace) -> int:
    speculate = not args.no_spec
    config = dataclasses.replace(engine_config(args, speculate), max_batch=args.max_batch)
    options = gateway_options(args)

    def load_in_process() -> Backend:
        target, draft = load_models(args, speculate)
        return Backend(build_engine(target, draft, config), target.tokenizer, args.target,
                       args.draft if speculate else "")

    load = load_in_process if args.in_process else _cluster_loader(args, config)

    def announce(address: str) -> None:
        print(f"tandem: serving tandem.v1.Generation on {address} (readiness turns SERVING once "
              f"{args.target} is loaded)", flush=True)

    with contextlib.ExitStack() as stack:
        sessions = _session_store(args.redis_url, stack)
        try:
            asyncio.run(serve(load, options, sessions=sessions, on_listening=announce))
        except OSError as exc:
            raise TandemError(str(exc)) from exc
        finally:
            if not args.in_process:
                with contextlib.suppress(ImportError):
                    import ray

                    ray.shutdown()
    return 0
