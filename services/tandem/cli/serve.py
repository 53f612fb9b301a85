"""`tandem serve`: start Ray workers (or load in-process), Redis session state, and the gRPC gateway."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import ipaddress
import json
import logging
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.cluster import ClusterOptions

from tandem.cli.canary import add_serve_canary_options, serve_canary_options
from tandem.cli.common import (
    add_model_options,
    add_ray_token_option,
    add_redis_options,
    engine_config,
    kv_tokens,
    load_models,
    pin_model_args,
    session_store_url,
    setup_torch,
)
from tandem.core.config import EngineConfig
from tandem.errors import InvalidArgument, TandemError
from tandem.gateway.generation import Backend
from tandem.gateway.server import GatewayOptions, check_tls_files, serve
from tandem.gateway.validate import GatewayLimits
from tandem.local_engine import build_engine
from tandem.telemetry import tracing
from tandem.telemetry.metrics import DEFAULT_PORT as DEFAULT_METRICS_PORT
from tandem.telemetry.worker import DEFAULT_WORKER_METRICS_PORT, METRICS_PORT_ENV

DEFAULT_HTTP_PORT = 8000  # vLLM's and most OpenAI-compatible servers' default


def add_serve_parser(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="serve the gRPC API: gateway, Ray draft and target workers, Redis")
    add_model_options(parser)
    add_pool_options(parser)
    parser.add_argument("--ray-address", default=None, help="join this Ray cluster (default: $RAY_ADDRESS or local)")
    add_ray_token_option(parser)
    parser.add_argument("--in-process", action="store_true", help="load both models in the gateway, no Ray")
    parser.add_argument("--no-spec", action="store_true", help="serve plain target decoding (no draft model)")
    add_gateway_options(parser)
    parser.add_argument("--worker-metrics-port", type=int, default=None,
                        help=f"first /metrics port of each Ray worker (default: ${METRICS_PORT_ENV} or "
                        f"{DEFAULT_WORKER_METRICS_PORT}; taken: the next free one; 0: a free port; -1: off)")
    add_serve_canary_options(parser)
    parser.set_defaults(handler=run_serve)


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


def cluster_options(args: argparse.Namespace) -> ClusterOptions:
    from tandem.cluster import ClusterOptions

    return ClusterOptions(draft_workers=args.draft_workers, target_replicas=args.target_replicas,
                          tensor_parallel=args.tp, draft_gpus=args.draft_gpus, target_gpus_per_rank=args.target_gpus,
                          draft_resources=_json_flag("draft_resources", args.draft_resources),
                          target_resources=_json_flag("target_resources", args.target_resources),
                          ray_address=args.ray_address, ray_token_file=args.ray_token_file, threads=args.threads,
                          device=args.device, dtype=args.dtype, eager=args.eager, kv_tokens=args.kv_tokens)


def add_gateway_options(parser: argparse.ArgumentParser) -> None:
    """The flags of the gRPC gateway itself, shared by `tandem serve` and `tandem gateway`."""
    add_redis_options(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=50051, help="0 picks a free port (default: %(default)s)")
    parser.add_argument("--http-port", type=int, default=None,
                        help="OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions) on --host "
                             f"(default: {DEFAULT_HTTP_PORT}, or a free port when taken; 0: a free port; -1: off)")
    parser.add_argument("--max-queue", type=int, default=256,
                        help="requests queued or running before RESOURCE_EXHAUSTED (default: %(default)s)")
    parser.add_argument("--max-batch", type=int, default=16, help="sequences per engine step (default: %(default)s)")
    parser.add_argument("--lanes", type=int, default=1,
                        help="engines over the same Ray workers, so one lane's rows draft while another's verify "
                             "(a lane takes requests once the lanes before it run --max-batch; not with --in-process "
                             "or with --tp > 1 under tandem serve; default: %(default)s)")
    parser.add_argument("--prefill-chunk", type=int, default=EngineConfig().prefill_chunk,
                        help="while others decode, prefill a new prompt at most this many tokens per step "
                             "(0: a prompt at once; default: %(default)s)")
    parser.add_argument("--max-tokens-limit", type=int, default=GatewayLimits().max_tokens,
                        help="largest max_tokens a request may ask for (default: %(default)s)")
    parser.add_argument("--max-prompt-tokens", type=int, default=GatewayLimits().max_prompt_tokens,
                        help="longest prompt in tokens (default: %(default)s)")
    parser.add_argument("--grace", type=float, default=30.0,
                        help="seconds in-flight requests may run on after SIGTERM (default: %(default)s)")
    parser.add_argument("--stall-timeout", type=float, default=60.0,
                        help="fail in-flight requests when one engine step runs longer (default: %(default)s)")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help=f"Prometheus /metrics port on --host (default: {DEFAULT_METRICS_PORT}, or a free port "
                        "when taken; 0: a free port; -1: off)")
    parser.add_argument("--no-metrics", action="store_true", help="serve no Prometheus metrics (gateway and workers)")
    parser.add_argument("--tls-cert", default=None, metavar="FILE",
                        help="serve gRPC and HTTP over TLS with this PEM certificate (chain); needs --tls-key")
    parser.add_argument("--tls-key", default=None, metavar="FILE", help="the PEM private key of --tls-cert")
    parser.add_argument("--tls-client-ca", default=None, metavar="FILE",
                        help="mutual TLS: clients must present a certificate signed by this PEM CA")
    parser.add_argument("--api-keys", default=None, metavar="FILE",
                        help="require an API key (`authorization: Bearer <key>`) on every call but health checks; "
                             "FILE maps key hashes to tenants (`tandem keys create`)")
    parser.add_argument("--insecure", action="store_true",
                        help="allow a --host beyond loopback without --api-keys (anyone who reaches it may call)")
    parser.add_argument("--tenant-queue-share", type=float, default=GatewayOptions().tenant_queue_share,
                        help="with --api-keys: the most of --max-queue one tenant may hold queued or running, so one "
                             "client cannot fill the queue (1: no cap; default: %(default)s)")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def gateway_options(args: argparse.Namespace) -> GatewayOptions:
    if not 0 <= args.port <= 65535:
        raise InvalidArgument(f"port: must be between 0 and 65535, got {args.port}")
    if args.max_queue < 1:
        raise InvalidArgument(f"max_queue: must be at least 1, got {args.max_queue}")
    if args.lanes < 1:
        raise InvalidArgument(f"lanes: must be at least 1, got {args.lanes}")
    if args.grace < 0 or args.stall_timeout <= 0:
        raise InvalidArgument("grace: must be non-negative; stall_timeout: must be positive")
    limits = GatewayLimits(max_tokens=args.max_tokens_limit, max_prompt_tokens=args.max_prompt_tokens)
    metrics_port = DEFAULT_METRICS_PORT if args.metrics_port is None else args.metrics_port
    if not -1 <= metrics_port <= 65535:
        raise InvalidArgument(f"metrics_port: must be between -1 (off) and 65535, got {metrics_port}")
    off = args.no_metrics or metrics_port == -1
    http_port = DEFAULT_HTTP_PORT if args.http_port is None else args.http_port
    if not -1 <= http_port <= 65535:
        raise InvalidArgument(f"http_port: must be between -1 (off) and 65535, got {http_port}")
    keys = None
    if args.api_keys is not None:
        from tandem.gateway.auth import ApiKeys

        keys = ApiKeys.load(args.api_keys)
    elif not args.insecure and not is_loopback(args.host):
        # Without keys, anyone who reaches the port may generate: only loopback unless the operator says so.
        raise InvalidArgument(f"host: {args.host} is reachable beyond this machine and no --api-keys were given; "
                              "pass --api-keys FILE (`tandem keys create`), or --insecure to serve it unauthenticated")
    options = GatewayOptions(host=args.host, port=args.port, limits=limits, max_requests=args.max_queue,
                             stall_timeout=args.stall_timeout, grace=args.grace,
                             metrics_port=None if off else metrics_port,
                             metrics_port_fallback=args.metrics_port is None,
                             http_port=None if http_port == -1 else http_port,
                             http_port_fallback=args.http_port is None,
                             tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca,
                             api_keys=keys, tenant_queue_share=args.tenant_queue_share)
    if options.tls:
        check_tls_files(options)  # now, before Ray or the models start
    return options


def worker_metrics_port(args: argparse.Namespace) -> int:
    """The port Ray workers serve /metrics on (-1: off), handed to them as $TANDEM_WORKER_METRICS_PORT."""
    if args.no_metrics:
        return -1
    port = args.worker_metrics_port
    if port is None:
        port = int(os.environ.get(METRICS_PORT_ENV) or DEFAULT_WORKER_METRICS_PORT)
    if not -1 <= port <= 65535:
        raise InvalidArgument(f"worker_metrics_port: must be between -1 (off) and 65535, got {port}")
    return port


def _json_flag(name: str, text: str | None):
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"{name}: not valid JSON ({exc.msg})") from exc


def _check_arms(args: argparse.Namespace, canary) -> None:
    """Arms share the gateway's target (one tokenizer, one plain reference): another target is refused."""
    if canary is None:
        return
    if others := [arm.name for arm in canary.arms if arm.target and arm.target != args.target]:
        raise InvalidArgument(f"arms: {', '.join(others)}: a target other than --target {args.target!r} is not "
                              "supported; serve it from another deployment")


def _arm_config(config, arm):
    return dataclasses.replace(config, spec=arm.spec_config(config.spec))


def _arm_draft(args: argparse.Namespace, arm, arm_config) -> str:
    """The arm's draft model name, "" when it decodes plainly."""
    return (arm.draft or args.draft or "") if arm_config.spec.speculating else ""


def _in_process_arms_loader(args: argparse.Namespace, config, canary):
    """{arm: Backend}: the target loaded once, each distinct draft once, one engine per arm."""

    def load() -> dict[str, Backend]:
        from tandem.models.loader import check_compatible, load_model

        device, dtype = setup_torch(args)
        target = load_model(args.target, device=device, dtype=dtype, eager=args.eager)
        drafts: dict[str, object] = {}
        backends = {}
        for arm in canary.arms:
            arm_config = _arm_config(config, arm)
            name = _arm_draft(args, arm, arm_config)
            if name and name not in drafts:
                drafts[name] = load_model(name, device=device, dtype=dtype, eager=args.eager)
                check_compatible(drafts[name], target)
            backends[arm.name] = Backend(build_engine(target, drafts[name] if name else None, arm_config,
                                                      kv_tokens=args.kv_tokens),
                                         target.tokenizer, args.target, name)
        return backends

    return load


def _cluster_loader(args: argparse.Namespace, config, canary=None):
    from tandem.cluster import start_arm_backends, start_backend, start_ray

    options = cluster_options(args)

    # A local Ray's workers inherit this environment: the metrics port, and OTEL_* for their own span export.
    os.environ[METRICS_PORT_ENV] = str(worker_metrics_port(args))
    # Ray starts here, on the main thread and before the gateway sets its SIGTERM handler: started later from the
    # loading thread, Ray's own handler would take SIGTERM over and abort instead of draining.
    start_ray(options)

    def load() -> Backend:
        backend = start_backend(args.target, args.draft if config.spec.speculating else None, config, options,
                                lanes=args.lanes)
        _announce_worker_metrics(backend)
        return backend

    def load_arms() -> dict[str, Backend]:
        # One backend per arm over one shared target pool; each distinct draft model gets its own draft pool.
        arms = {}
        for arm in canary.arms:
            arm_config = _arm_config(config, arm)
            arms[arm.name] = (_arm_draft(args, arm, arm_config) or None, arm_config)
        backends = start_arm_backends(args.target, arms, options, lanes=args.lanes)
        for backend in backends.values():
            _announce_worker_metrics(backend)
        return backends

    return load if canary is None else load_arms


def _announce_worker_metrics(backend: Backend) -> None:
    import ray

    from tandem.workers.fanout import RayPoolClient

    engine = backend.engine
    actors = [actor for side in (engine.drafter, engine.verifier) if isinstance(side, RayPoolClient)
              for actor in side.actors()]
    try:
        infos = ray.get([actor.info.remote() for actor in actors], timeout=30)
    except Exception as exc:  # only an announcement: serving goes on
        logging.getLogger(__name__).warning("could not list the workers' metrics endpoints: %s", exc)
        return
    urls = [f"{info['name']} {info['metrics']}" for info in infos if info.get("metrics")]
    if urls:
        print(f"tandem: worker metrics at {', '.join(urls)}", flush=True)


def _session_store(url: str | None, stack: contextlib.ExitStack):
    """The store at `url` (credentials folded in: session_store_url), else in an embedded Redis of our own."""
    from tandem.sessions import EmbeddedRedis, open_session_store

    if not url:
        try:
            redis = stack.enter_context(EmbeddedRedis())
        except RuntimeError as exc:
            logging.getLogger(__name__).warning("no Redis: keeping session state in memory (%s)", exc)
            return open_session_store(None)
        url = redis.url
        print(f"tandem: session state in embedded Redis at {redis.redacted_url}", flush=True)
    return open_session_store(url)


def run_serve(args: argparse.Namespace) -> int:
    speculate = not args.no_spec
    config = dataclasses.replace(engine_config(args, speculate), max_batch=args.max_batch,
                                 prefill_chunk=args.prefill_chunk)
    options = gateway_options(args)
    kv_tokens(args)  # checked before anything starts
    session_store_url(args)  # ... and the Redis password file and CA
    canary = serve_canary_options(args)  # None: no canary arms, one backend
    _check_arms(args, canary)
    pin_model_args(args)  # a hub id's commit, fixed before Ray's workers (each loading the models) start
    exporters = tracing.setup_from_env("tandem-gateway")  # before Ray starts: a bad OTEL_* setting fails first

    def load_in_process() -> Backend:
        target, draft = load_models(args, speculate)
        return Backend(build_engine(target, draft, config, kv_tokens=args.kv_tokens), target.tokenizer, args.target,
                       args.draft if speculate else "")

    if args.in_process:
        if args.lanes > 1:
            raise InvalidArgument("lanes: --in-process runs one engine over its models (lanes need Ray workers)")
        load = load_in_process if canary is None else _in_process_arms_loader(args, config, canary)
    else:
        load = _cluster_loader(args, config, canary)

    try:
        return serve_gateway(args, load, options, canary, exporters, model=args.target)
    finally:
        if not args.in_process:
            with contextlib.suppress(ImportError):
                import ray

                ray.shutdown()


def serve_gateway(args: argparse.Namespace, load, options: GatewayOptions, canary, exporters, model: str) -> int:
    """Run the gRPC gateway over the backend `load()` returns until SIGTERM/SIGINT (with the session store)."""

    security = ("mutual TLS" if options.tls_client_ca else "TLS") if options.tls else "plaintext"
    if options.api_keys is not None:
        security += f", {len(options.api_keys)} API keys"

    def announce(address: str) -> None:
        # The address stays bare (HOST:PORT, what clients take): scripts read it from this line.
        print(f"tandem: serving tandem.v1.GenerationService on {address} ({security}; readiness turns SERVING once "
              f"{model} is loaded)", flush=True)

    def announce_metrics(url: str) -> None:
        print(f"tandem: Prometheus metrics at {url}", flush=True)

    def announce_http(url: str) -> None:
        print(f"tandem: serving the OpenAI-compatible HTTP API on {url}/v1", flush=True)

    with contextlib.ExitStack() as stack:
        sessions = _session_store(session_store_url(args), stack)
        stack.callback(tracing.shutdown)  # flushes the last spans
        if exporters:
            print(f"tandem: tracing on, exporting to {', '.join(exporters)} (OTEL_* variables)", flush=True)
        try:
            if canary is not None:
                print(f"tandem: canary arms {', '.join(f'{arm.name}={arm.weight:g}' for arm in canary.arms)} "
                      f"(deployment {canary.deployment}; `tandem canary status`)", flush=True)
            asyncio.run(serve(load, options, sessions=sessions, on_listening=announce, on_metrics=announce_metrics,
                              on_http=announce_http, canary=canary))
        except OSError as exc:
            raise TandemError(str(exc)) from exc
    return 0
