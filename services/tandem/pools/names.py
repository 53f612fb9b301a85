"""Where shared pools live on a Ray cluster: the namespace of their named detached actors, each pool's manager, and
the calls that only ask a manager (find, list, stop).

Ray alone, no model stack: `tandem pools status|scale|stop` and the gateways look pools up through this module, and a
command that only asks a manager should not import torch and transformers first (seconds of every call).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import ray

from tandem.errors import InvalidArgument, TandemError

NAMESPACE = "tandem"  # the Ray namespace of shared pools' named actors
MANAGER_PREFIX = "tandem-pools-"
STOP_TIMEOUT_S = 60.0
_WORKER_NAME = re.compile(r"(?:draft|target)-\d+(?:-rank\d+)?")  # a worker's name after its pools' prefix


def check_pool_name(name: str, field: str = "name") -> None:
    """InvalidArgument naming `field` unless `name` can name pools: letters, digits and dashes."""
    if not name or not name.replace("-", "").isalnum():
        raise InvalidArgument(f"{field}: letters, digits and dashes only, got {name!r}")


def manager_name(pool: str) -> str:
    """The pool manager's actor name; its workers are named `{manager_name(pool)}-{role}-{index}`."""
    return f"{MANAGER_PREFIX}{pool}"


def find_manager(pool: str):
    """The running pool's manager actor; a clear error when there is none."""
    try:
        return ray.get_actor(manager_name(pool), namespace=NAMESPACE)
    except ValueError as exc:
        raise TandemError(f"no pools named {pool!r} on this Ray cluster (`tandem pools start --name {pool}`)") from exc


def all_managers() -> list:
    """Every pool manager on the cluster. A worker's name is its manager's name, a dash and more: a name that another
    one starts so is a worker's, not a manager's."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == NAMESPACE and a["name"].startswith(MANAGER_PREFIX)]
    managers = [n for n in names if not any(n.startswith(m + "-") for m in names if m != n)]
    return [ray.get_actor(n, namespace=NAMESPACE) for n in managers]


def stop_pools(manager) -> None:
    """Stop the pool's workers, then its manager (killed even when stopping the workers fails)."""
    try:
        ray.get(manager.stop.remote(), timeout=STOP_TIMEOUT_S)
    finally:
        ray.kill(manager, no_restart=True)


def stop_orphans(pool: str, report: Callable[[str], None]) -> None:
    """Workers named for `pool` with no manager: a manager lost uncleanly left them (detached, they outlive it),
    owned by no pool, and their names would refuse new pools' workers. Pools named POOL-x are not POOL's."""
    prefix = f"{manager_name(pool)}-"

    def ours(name: str) -> bool:
        return name.startswith(prefix) and _WORKER_NAME.fullmatch(name[len(prefix):]) is not None

    orphans = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
               if a["namespace"] == NAMESPACE and ours(a["name"])]
    for name in orphans:
        ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
    for group in ray.util.placement_group_table().values():  # a tensor-parallel replica's
        if ours(group.get("name", "")) and group.get("state") != "REMOVED":
            ray.util.remove_placement_group(ray.util.get_placement_group(group["name"]))
    if orphans:
        report(f"pools {pool}: stopped {len(orphans)} workers that pools of this name left behind when their "
               f"manager was lost: {', '.join(name[len(prefix):] for name in orphans)}")
