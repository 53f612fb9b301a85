"""Shared worker pools: draft workers and target replicas that live on the Ray cluster as named detached actors,
started and scaled by `tandem pools`, used by any number of stateless `tandem gateway` processes (a gateway's engine
over them is built by tandem.engines.shared_pools)."""

from tandem.pools.manager import PoolSpec, find_manager, start_pools

__all__ = ["PoolSpec", "find_manager", "start_pools"]
