"""Shared worker pools: draft workers and target replicas that live on the Ray cluster as named detached actors,
started and scaled by `tandem pools` (tandem.pools.manager), used by any number of stateless `tandem gateway`
processes (a gateway's engine over them is built by tandem.engines.shared_pools).

Importing the package imports tandem.pools.names alone (Ray, no torch): see that module for why."""

from tandem.pools.names import NAMESPACE, find_manager

__all__ = ["NAMESPACE", "find_manager"]
