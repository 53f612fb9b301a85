"""A stateless gateway's engine over running shared pools.

The gateway keeps only the tokenizer and its own sessions' bookkeeping; the workers and their KV caches belong to
the pools. Each gateway prefixes the sequence ids it sends with its own random tag (request ids from different
gateways may be equal), and a watcher thread follows the pool's membership (`tandem pools scale`): a new set of
workers is taken up at the engine's next call, moving only the sessions of workers that came or went.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import uuid

import ray

from tandem.cluster import load_tokenizer
from tandem.core.config import EngineConfig
from tandem.core.engine import SpeculativeEngine
from tandem.gateway.servicer import Backend
from tandem.local_engine import decoder
from tandem.pools.manager import find_manager
from tandem.workers.draft_pool import RayDrafter
from tandem.workers.fanout import RayPoolClient
from tandem.workers.target_pool import RayVerifier
from tandem.workers.worker_base import NAMESPACE

log = logging.getLogger(__name__)

MEMBERSHIP_POLL_S = 2.0


def _handles(description: dict, role: str) -> list:
    prefix = description["actor_prefix"]
    return [ray.get_actor(prefix + name, namespace=NAMESPACE) for name in description["workers"][role]]


def attach_backend(pool: str, max_batch: int | None = None, prefill_chunk: int | None = None,
                   draft_timeout_s: float = 5.0, stop: threading.Event | None = None) -> Backend:
    """An engine driving the pool named `pool` (Ray must be initialised). `max_batch` and `prefill_chunk` override
    the pool's engine config for this gateway; `stop` ends the membership watcher."""
    manager = find_manager(pool)
    description = ray.get(manager.describe.remote())
    tokenizer, eos = load_tokenizer(description["target"])
    tag = f"{uuid.uuid4().hex[:12]}/"
    verifier = RayVerifier(_handles(description, "target"), names=description["workers"]["target"], prefix=tag)
    drafter = None
    config: EngineConfig = description["engine"]
    if description["draft"] and config.spec.speculating:
        drafter = RayDrafter(_handles(description, "draft"), timeout_s=draft_timeout_s,
                             names=description["workers"]["draft"], prefix=tag)
    changes = {k: v for k, v in (("max_batch", max_batch), ("prefill_chunk", prefill_chunk)) if v is not None}
    engine = SpeculativeEngine(verifier, drafter, dataclasses.replace(config, **changes), eos, decoder(tokenizer))
    watcher = threading.Thread(target=_follow_membership, name="tandem-pool-members", daemon=True,
                               args=(manager, description["generation"], verifier, drafter, stop or threading.Event()))
    watcher.start()
    log.info("attached to pools %r: %d target replica(s), %d draft worker(s)", pool, len(verifier.workers),
             len(drafter.workers) if drafter else 0)
    return Backend(engine, tokenizer, description["target"], description["draft"] if drafter else "")


def _follow_membership(manager, generation: int, verifier: RayPoolClient, drafter: RayPoolClient | None,
                       stop: threading.Event) -> None:
    while not stop.wait(MEMBERSHIP_POLL_S):
        try:
            description = ray.get(manager.describe.remote(), timeout=MEMBERSHIP_POLL_S * 5)
            if description["generation"] == generation:
                continue
            for role, client in (("target", verifier), ("draft", drafter)):
                if client is not None:
                    client.offer_workers(_handles(description, role), description["workers"][role])
            generation = description["generation"]
            log.warning("pools %r now: %s", description["name"],
                        {role: len(names) for role, names in description["workers"].items()})
        except Exception as exc:  # the manager restarting or a worker not yet named: try again next poll
            log.warning("could not follow the pools' membership: %s", exc)
