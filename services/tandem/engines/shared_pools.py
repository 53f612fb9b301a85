"""A stateless gateway's engine over running shared pools.

The gateway keeps only the tokenizer and its own sessions' bookkeeping; the workers and their KV caches belong to
the pools. Each gateway prefixes the sequence ids it sends with its Ray job id and a random tag (request ids from
different gateways may be equal; workers release the sequences of a gateway whose job died, workers.orphans), and
a watcher thread follows the pool's membership (`tandem pools scale`): a new set of workers is taken up at the
engine's next call, moving only the sessions of workers that came or went.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import uuid
from collections.abc import Callable

import ray

from tandem.core.config import EngineConfig
from tandem.core.costs import CostModel
from tandem.core.detok import decoder
from tandem.engines.backend import Backend, engine_lanes
from tandem.errors import TandemError
from tandem.pools.manager import IMAGE_ENV
from tandem.pools.names import NAMESPACE, find_manager
from tandem.workers.draft_pool import RayDrafter
from tandem.workers.fanout import RayPoolClient
from tandem.workers.orphans import owner_tag
from tandem.workers.target_pool import RayVerifier, target_tokenizer

log = logging.getLogger(__name__)

MEMBERSHIP_POLL_S = 2.0
# `tandem gateway`'s exit status once its pools came back with other models: not 0, so that a supervisor that
# restarts failed processes only (systemd's Restart=on-failure) starts the fresh gateway they need.
EXIT_MODELS_CHANGED = 3
_exit_status = 0


def exit_status() -> int:
    """What the gateway process should exit with once it has drained (0, or EXIT_MODELS_CHANGED)."""
    return _exit_status


def exit_after_drain(status: int) -> None:
    global _exit_status
    _exit_status = status


def _handles(description: dict, role: str) -> list:
    prefix = description["actor_prefix"]
    return [ray.get_actor(prefix + name, namespace=NAMESPACE) for name in description["workers"][role]]


def attach_backend(pool: str, max_batch: int | None = None, prefill_chunk: int | None = None,
                   draft_timeout_s: float = 5.0, stop: threading.Event | None = None, lanes: int = 1,
                   max_prefill_tokens: int | None = None) -> Backend:
    """An engine driving the pool named `pool` (Ray must be initialised). `max_batch`, `prefill_chunk` and
    `max_prefill_tokens` override the pool's engine config for this gateway; `lanes` engines share the pools
    (gateway.lanes); `stop` ends the membership watcher."""
    manager = find_manager(pool)
    description = ray.get(manager.describe.remote())
    check_image(pool, description.get("image", ""), os.environ.get(IMAGE_ENV, ""))
    tag = f"{owner_tag()}{uuid.uuid4().hex[:12]}/"  # the job first: workers release a dead gateway's sequences
    config: EngineConfig = description["engine"]
    speculating = bool(description["draft"]) and config.spec.speculating
    targets, drafts = _handles(description, "target"), _handles(description, "draft") if speculating else []
    tokenizer, eos = target_tokenizer(targets, f"pools {pool!r}")
    clients: list[RayPoolClient] = []

    def sides(lane: int) -> tuple[RayVerifier, RayDrafter | None]:
        prefix = f"{tag}{lane}/" if lanes > 1 else tag
        verifier = RayVerifier(targets, names=description["workers"]["target"], prefix=prefix,
                               tensor_parallel=description.get("tensor_parallel", 1))
        drafter = RayDrafter(drafts, timeout_s=draft_timeout_s, names=description["workers"]["draft"],
                             prefix=prefix) if speculating else None
        clients.extend(side for side in (verifier, drafter) if side is not None)
        return verifier, drafter

    changes = {k: v for k, v in (("max_batch", max_batch), ("prefill_chunk", prefill_chunk),
                                 ("max_prefill_tokens", max_prefill_tokens)) if v is not None}
    config = dataclasses.replace(config, **changes)
    # One gateway times the pools' forwards; the others adopt its costs rather than run calibration forwards on
    # workers that serve traffic (a gateway the autoscaler adds would slow every stream while it starts).
    measured: CostModel | None = ray.get(manager.calibration.remote(config.max_batch)) if speculating else None
    engines = engine_lanes(sides, lanes, dataclasses.replace(config, calibrate=config.calibrate and measured is None),
                           eos, decoder(tokenizer))

    def record(to_manager) -> None:
        """Give a manager the costs this gateway serves with (the first gateway to do so sets them): after its own
        calibration, and again to a restarted manager, which lost those it kept in memory, so that a gateway
        attaching later adopts them instead of timing forwards on workers that serve traffic. The engine's thread
        keeps adapting its own: a copy goes."""
        if speculating and engines[0].costs.calibrated:
            ray.get(to_manager.record_calibration.remote(config.max_batch,
                                                         CostModel.from_dict(engines[0].costs.to_dict())))

    if measured is not None:
        engines[0].costs.adopt(measured)  # the lanes share the first lane's cost model
        log.info("adopted the pools' calibration (batches up to %d)", config.max_batch)
    else:
        record(manager)
    watcher = threading.Thread(target=_follow_membership, name="tandem-pool-members", daemon=True,
                               args=(pool, manager, description, clients, stop or threading.Event(), record))
    watcher.start()
    log.info("attached to pools %r: %d target replica(s), %d draft worker(s), %d lane(s)", pool, len(targets),
             len(drafts), lanes)
    return Backend(engines[0], tokenizer, description["target"], description["draft"] if speculating else "",
                   lanes=tuple(engines[1:]))


def check_image(pool: str, pools_image: str, own_image: str) -> None:
    """A gateway never serves over workers of another build unnoticed (an upgrade half done): both images known
    and different is an error naming both."""
    if pools_image and own_image and pools_image != own_image:
        raise TandemError(f"image: this gateway runs {own_image} but pools {pool!r} run {pools_image}; restart the "
                          f"pools on {own_image} (`tandem pools stop` and `start`) or roll the gateways back")


def _follow_membership(pool: str, manager, description: dict, clients: list[RayPoolClient],
                       stop: threading.Event, record: Callable[[object], None]) -> None:
    """Follow the pools' membership (scaling, dead workers dropped, a restarted manager, pools started anew) until
    `stop`; `record(manager)` gives a new manager incarnation this gateway's costs. Pools that came back with other
    models cannot be served with this gateway's tokenizer: the gateway then drains and exits (SIGTERM to itself), and
    its supervisor starts a fresh one that attaches to them."""
    seen = (description["incarnation"], description["generation"])
    models = (description["target"], description["draft"])
    failing = ""  # the last failure logged: one line per new failure, not one per poll
    while not stop.wait(MEMBERSHIP_POLL_S):
        try:
            try:
                description = ray.get(manager.describe.remote(), timeout=MEMBERSHIP_POLL_S * 5)
            except Exception:
                manager = find_manager(pool)  # restarted, or stopped and started anew: look it up by name again
                description = ray.get(manager.describe.remote(), timeout=MEMBERSHIP_POLL_S * 5)
            if failing:
                log.warning("pools %r answer again", pool)
                failing = ""
            _mark_gone(clients, False)
            if (description["incarnation"], description["generation"]) == seen:
                continue
            if (description["target"], description["draft"]) != models:
                log.error("pools %r now run target %s, draft %s (this gateway attached to %s, %s): exiting (status %d) "
                          "so that a fresh gateway attaches", pool, description["target"],
                          description["draft"] or "-", models[0], models[1] or "-", EXIT_MODELS_CHANGED)
                exit_after_drain(EXIT_MODELS_CHANGED)
                os.kill(os.getpid(), signal.SIGTERM)
                return
            if description["incarnation"] != seen[0]:
                record(manager)
            handles = {role: _handles(description, role) for role in ("target", "draft")}
            for client in clients:
                role = "target" if isinstance(client, RayVerifier) else "draft"
                client.offer_workers(handles[role], description["workers"][role])
            seen = (description["incarnation"], description["generation"])
            log.warning("pools %r now: %s", pool, {role: len(names) for role, names in description["workers"].items()})
        except Exception as exc:  # the manager restarting or a worker not yet named: try again next poll
            if isinstance(exc, TandemError):  # no manager by that name: the pools were stopped
                _mark_gone(clients, True)
            if str(exc) != failing:
                failing = str(exc)
                log.warning("could not follow the pools' membership: %s%s", exc, "; requests fail UNAVAILABLE until "
                            "they are started again" if isinstance(exc, TandemError) else "")


def _mark_gone(clients: list[RayPoolClient], gone: bool) -> None:
    """Pools no longer listed (stopped) or listed again: a call waiting for their workers to come back stops."""
    for client in clients:
        client.pools_gone = gone
