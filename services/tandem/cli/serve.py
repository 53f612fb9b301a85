"""`tandem serve`: build the engines (Ray workers, or models in this process) and serve them through the gateway,
with Redis session state; with canary arms, one backend per arm (tandem.engines.build)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
from typing import TYPE_CHECKING

from tandem import engines
from tandem.cli.canary import add_serve_canary_options, serve_canary_options
from tandem.cli.common import (
    add_calibration_file_option,
    add_model_options,
    announce_compile,
    calibration_file,
    engine_config,
    kv_tokens,
    local_options,
    pin_model_args,
)
from tandem.cli.redis_options import session_store_url
from tandem.cli.serving import add_gateway_options, gateway_options, serve_gateway
from tandem.cli.worker_options import (
    add_pool_options,
    add_ray_token_option,
    add_worker_metrics_option,
    worker_metrics_port,
)
from tandem.core.config import EngineConfig
from tandem.engines import Arm, Backend, BuildOptions, ClusterOptions
from tandem.errors import InvalidArgument
from tandem.telemetry import tracing
from tandem.telemetry.worker import METRICS_HOST_ENV, METRICS_PORT_ENV

if TYPE_CHECKING:
    from tandem.canary.arms import ArmSpec
    from tandem.canary.config import CanaryOptions

log = logging.getLogger(__name__)


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve")  # its help line is in tandem.cli.main.COMMANDS

    add_model_options(parser)
    add_pool_options(parser)
    parser.add_argument("--ray-address", default=None, help="join this Ray cluster (default: $RAY_ADDRESS or local)")
    add_ray_token_option(parser)
    parser.add_argument("--in-process", action="store_true", help="load both models in the gateway, no Ray")
    parser.add_argument("--no-spec", action="store_true", help="serve plain target decoding (no draft model)")
    add_calibration_file_option(parser)
    add_gateway_options(parser)
    add_worker_metrics_option(parser)
    add_serve_canary_options(parser)
    parser.set_defaults(handler=run_serve)


def cluster_options(args: argparse.Namespace) -> ClusterOptions:
    return ClusterOptions(draft_workers=args.draft_workers, target_replicas=args.target_replicas,
                          tensor_parallel=args.tp, draft_gpus=args.draft_gpus, target_gpus_per_rank=args.target_gpus,
                          draft_resources=_json_flag("draft_resources", args.draft_resources),
                          target_resources=_json_flag("target_resources", args.target_resources),
                          ray_address=args.ray_address, ray_token_file=args.ray_token_file, threads=args.threads,
                          device=args.device, dtype=args.dtype, eager=args.eager, compile=args.compile,
                          kv_tokens=args.kv_tokens, retain_tokens=args.retain_tokens, prefix_cache=args.prefix_cache,
                          draft_quantization=args.draft_quantization)


def _json_flag(name: str, text: str | None):
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"{name}: not valid JSON ({exc.msg})") from exc


def build_options(args: argparse.Namespace, config: EngineConfig, canary: CanaryOptions | None) -> BuildOptions:
    """What to build: one backend, or one per canary arm (its speculation overrides applied to `config`), in this
    process (--in-process) or over Ray pools."""
    if canary is None:
        arms = (Arm("", args.draft if config.spec.speculating else "", config),)
    else:
        arms = tuple(_arm(args, config, arm) for arm in canary.arms)
    placement = local_options(args) if args.in_process else cluster_options(args)
    return BuildOptions(args.target, arms, placement, lanes=args.lanes, calibration_file=calibration_file(args))


def _check_arms(args: argparse.Namespace, canary: CanaryOptions | None) -> None:
    """Arms share the gateway's target (one tokenizer, one plain reference): another target is refused."""
    if canary is None:
        return
    if others := [arm.name for arm in canary.arms if arm.target and arm.target != args.target]:
        raise InvalidArgument(f"arms: {', '.join(others)}: a target other than --target {args.target!r} is not "
                              "supported; serve it from another deployment")


def _arm(args: argparse.Namespace, config: EngineConfig, arm: ArmSpec) -> Arm:
    """A canary arm (tandem.canary.arms.ArmSpec) as an engine to build; its draft is "" when it decodes plainly."""
    arm_config = dataclasses.replace(config, spec=arm.spec_config(config.spec))
    return Arm(arm.name, (arm.draft or args.draft or "") if arm_config.spec.speculating else "", arm_config)


def _announce_worker_metrics(backend: Backend) -> None:
    import ray

    from tandem.workers.fanout import RayPoolClient

    engine = backend.engine
    actors = [actor for side in (engine.drafter, engine.verifier) if isinstance(side, RayPoolClient)
              for actor in side.actors()]
    try:
        infos = ray.get([actor.info.remote() for actor in actors], timeout=30)
    except Exception as exc:  # only an announcement: serving goes on
        log.warning("could not list the workers' metrics endpoints: %s", exc)
        return
    urls = [f"{info['name']} {info['metrics']}" for info in infos if info.get("metrics")]
    if urls:
        print(f"tandem: worker metrics at {', '.join(urls)}", flush=True)


def run_serve(args: argparse.Namespace) -> int:
    config = dataclasses.replace(engine_config(args, not args.no_spec), max_batch=args.max_batch,
                                 prefill_chunk=args.prefill_chunk, max_prefill_tokens=args.max_prefill_tokens)
    options = gateway_options(args)
    kv_tokens(args)  # checked before anything starts
    session_store_url(args)  # ... and the Redis password file and CA
    canary = serve_canary_options(args)  # None: no canary arms, one backend
    _check_arms(args, canary)
    pin_model_args(args)  # a hub id's commit, fixed before Ray's workers (each loading the models) start
    exporters = tracing.setup_from_env("tandem-gateway")  # before Ray starts: a bad OTEL_* setting fails first
    build = build_options(args, config, canary)
    announce_compile(args)
    pools = isinstance(build.placement, ClusterOptions)
    if not pools and args.device.startswith("cuda"):
        from tandem.core.device import select_device

        select_device(args.device)  # CudaUnavailable says why, before the gateway announces what it will serve
    if pools:
        from tandem.core.kv_cache import HOST_WORKERS_ENV
        from tandem.engines.cluster import joined_ray, start_ray

        # A local Ray's workers inherit this environment: the metrics port (on the gateway's --host: Ray's node
        # address is the machine's network one), and OTEL_* for their own span export.
        os.environ[METRICS_PORT_ENV] = str(worker_metrics_port(args))
        if not joined_ray(build.placement):
            os.environ[METRICS_HOST_ENV] = args.host
            # Every worker runs on this host: their default KV budgets share its memory (core.kv_cache).
            os.environ[HOST_WORKERS_ENV] = str(build.placement.draft_workers * (not args.no_spec) +
                                               build.placement.target_replicas * build.placement.tensor_parallel)
        # Ray starts here, on the main thread and before the gateway sets its SIGTERM handler: started later from
        # the loading thread, Ray's own handler would take SIGTERM over and abort instead of draining.
        start_ray(build.placement)

    def load() -> dict[str, Backend]:
        backends = engines.build(build)
        if pools:
            for backend in backends.values():
                _announce_worker_metrics(backend)
        return backends

    try:
        return serve_gateway(args, load, options, canary, exporters, model=args.target)
    finally:
        if pools:
            with contextlib.suppress(ImportError):
                import ray

                ray.shutdown()
