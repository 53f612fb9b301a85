"""From built engines to a serving generate path: one serving loop per arm, the arm router, and Generations.

Runs once per gateway, in its loading phase: the engines are built off the event loop (the loader blocks while
models load and workers start), each arm's loop is started, and the arm router, when the gateway has one, is
started last, with plain decoding on the baseline arm's loop for its exactness checks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import TypeVar

from tandem.core.formats import build_in_background
from tandem.engines import Backend
from tandem.errors import TandemError
from tandem.gateway.arms import ArmRouter, ArmRouterFactory, plain_decoder
from tandem.gateway.generation import Generations
from tandem.gateway.handles import SessionStore
from tandem.gateway.lanes import LanedLoop, ServingLoop
from tandem.gateway.loop import EngineLoop
from tandem.gateway.options import GatewayOptions
from tandem.gateway.request_registry import LocalRegistry, RedisRequestRegistry, RequestRegistry
from tandem.sessions import RedisSessionStore
from tandem.telemetry.metrics import GatewayMetrics

log = logging.getLogger(__name__)
T = TypeVar("T")


async def load_generations(load: Callable[[], Backend | Mapping[str, Backend]], options: GatewayOptions,
                           metrics: GatewayMetrics | None, sessions: SessionStore | None,
                           arm_routers: ArmRouterFactory | None) -> Generations:
    """Build the engines (`load`, in a thread), start their loops and the arm router; on a failure, close what
    started and re-raise."""
    loops: dict[str, ServingLoop] = {}
    router: ArmRouter | None = None
    try:
        backends = arm_backends(await in_own_thread(load), routed=arm_routers is not None)
        for name, backend in backends.items():
            loops[name] = serving_loop(backend, options, metrics, sessions)
            await loops[name].start()
        baseline = next(iter(backends))
        for backend in backends.values():  # llguidance's tokenizer (1-2 s), before the first formatted request
            build_in_background(backend.tokenizer, backend.engine.eos_token_ids)
        if metrics is not None:
            metrics.attach(loops[baseline], backends[baseline].target_name, backends[baseline].draft_name)
        if arm_routers is not None:
            plain = plain_decoder(loops[baseline], asyncio.get_running_loop())
            provider = metrics.endpoint.provider if metrics is not None else None
            router = await asyncio.to_thread(arm_routers.start, list(backends), plain, provider)
    except Exception as exc:
        for started in loops.values():
            await started.close()
        if isinstance(exc, TandemError):  # a user-facing message; whoever awaits the gateway's ready() reports it
            log.info("loading the engine failed: %s", exc)
        else:
            log.exception("loading the engine failed")
        raise
    keys = options.api_keys
    tenants = keys.tenants if keys is not None else {}
    tenant_limits = {name: tenant.max_concurrency for name, tenant in tenants.items()
                     if tenant.max_concurrency is not None}
    tenant_priorities = {name: tenant.priority for name, tenant in tenants.items() if tenant.priority}
    generations = Generations(backends[baseline], loops, options.limits, metrics, tenant_limits,
                              options.tenant_queue_share if keys is not None else 1.0, router, tenant_priorities,
                              request_registry(sessions))
    await generations.registry.start(generations.abort_here)
    return generations


def request_registry(sessions: SessionStore | None) -> RequestRegistry:
    """Running request ids shared with the other gateway replicas in the sessions' Redis (else this gateway's)."""
    if isinstance(sessions, RedisSessionStore):
        return RedisRequestRegistry(sessions.url)
    return LocalRegistry()


LOADER_THREAD = "tandem-loader"


def loader_running() -> bool:
    """Whether a load is still running in its thread: a gateway stopped while its models loaded (a SIGTERM during
    start-up) leaves it behind, since a thread cannot be cancelled."""
    return any(thread.name == LOADER_THREAD and thread.is_alive() for thread in threading.enumerate())


async def in_own_thread(call: Callable[[], T]) -> T:
    """`call()` in a thread that ends when it returns, rather than in the event loop's executor, whose threads live on.

    torch's CPU thread pool is OpenMP's (libgomp), which keeps a team of threads for every thread that ran a parallel
    op, for as long as that thread lives. Loading and calibrating run such ops; the engine's thread then runs its own
    team. With more of these threads than CPUs, libgomp spins only ~100 iterations before putting a waiting thread
    to sleep, so every op of a forward waited for a wake-up: with the loader's team kept in an executor thread, the
    served engine's forwards ran about 1.5x slower than the same engine's in one thread (docs/performance.md)."""
    done: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        if not done.set_running_or_notify_cancel():  # the wait was cancelled before the thread started
            return
        try:
            done.set_result(call())
        except BaseException as exc:  # re-raised by the awaiting coroutine
            done.set_exception(exc)

    threading.Thread(target=run, name=LOADER_THREAD, daemon=True).start()
    # wrap_future drops a result that arrives for a cancelled wait, or after the event loop closed.
    return await asyncio.wrap_future(done)


def arm_backends(loaded: Backend | Mapping[str, Backend], routed: bool) -> dict[str, Backend]:
    """{arm: Backend}, the baseline first; a lone Backend is arm "". Several arms need an arm router to place
    requests on them."""
    if isinstance(loaded, Backend):
        return {"": loaded}
    if not isinstance(loaded, Mapping) or not loaded or not all(isinstance(b, Backend) for b in loaded.values()):
        raise TandemError("the loader must return a Backend or {arm name: Backend}")
    if len(loaded) > 1 and not routed:
        raise TandemError(f"the loader returned arms {list(loaded)}, but the gateway has no arm router")
    return dict(loaded)


def serving_loop(backend: Backend, options: GatewayOptions, metrics: GatewayMetrics | None,
                 sessions: SessionStore | None) -> ServingLoop:
    """One EngineLoop over the backend's engine, or a LanedLoop over its lanes (a thread each)."""
    engines, settle = backend.engines, backend.fills_cpus
    if (forced := os.environ.get("TANDEM_SETTLE")) in ("0", "1"):  # overrides the choice: A/B runs, a host's quirks
        settle = forced == "1"
    if len(engines) == 1:
        return EngineLoop(engines[0], options.max_requests, options.stall_timeout, sessions, metrics, settle=settle)
    return LanedLoop([EngineLoop(engine, options.max_requests, options.stall_timeout, sessions, metrics,
                                 thread_name=f"tandem-engine-{index}", settle=settle)
                      for index, engine in enumerate(engines)],
                     options.max_requests)
