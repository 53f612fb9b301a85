"""Starting pools from outside the cluster (`tandem pools start`): refuse a name already running, stop what a lost
manager left behind, start the manager as a named detached actor (pools.manager) and follow its workers' loading until
every one is ready; a start that fails, times out or is interrupted leaves nothing behind.

This runs in the starter's process; pools.manager is the actor's code, which Ray loads on the cluster.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import ray

from tandem.errors import InvalidArgument, TandemError
from tandem.pools.manager import PoolManager, PoolSpec
from tandem.pools.names import NAMESPACE, find_manager, manager_name, stop_orphans, stop_pools
from tandem.pools.waiting import wait_ready


def start_pools(spec: PoolSpec, timeout_s: float, report: Callable[[str], None]) -> dict:
    """Start the pool's manager and its workers as detached actors; returns its description once they are ready.
    `report` is told of each worker's progress (pools.waiting)."""
    try:
        find_manager(spec.name)
    except TandemError:
        pass
    else:
        raise InvalidArgument(f"name: pools named {spec.name!r} are already running (`tandem pools status`)")
    stop_orphans(spec.name, report)
    try:
        manager = ray.remote(PoolManager).options(name=manager_name(spec.name), namespace=NAMESPACE,
                                                  lifetime="detached", num_cpus=0, max_restarts=-1,
                                                  max_concurrency=8).remote(spec)
    except ValueError:  # (Ray's ActorAlreadyExistsError is one) another start of this name won the race
        raise InvalidArgument(f"name: pools named {spec.name!r} are already running (`tandem pools status`)") \
            from None
    try:
        described = ray.get(manager.start.remote())
        wait_ready(manager, spec.name, [n for names in described["starting"].values() for n in names], timeout_s,
                   report)
        return ray.get(manager.describe.remote())
    except BaseException as exc:  # a failed or timed-out start, or the starter interrupted: nothing stays behind
        from tandem.workers.worker_base import user_error

        with contextlib.suppress(ray.exceptions.RayError):  # a `tandem pools stop` meanwhile: already gone
            stop_pools(manager)
        if isinstance(exc, Exception) and (failed := user_error(exc)) is not None:
            raise failed from None  # its message alone, not the manager's remote traceback
        raise
