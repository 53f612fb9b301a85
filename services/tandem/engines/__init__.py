"""Building engines: in process (engines.local), over Ray pools started for this server (engines.cluster), over
shared pools other processes run (engines.shared_pools, for `tandem gateway --pools`), one backend per canary arm,
and lanes of engines over the same workers (engines.backend.engine_lanes).

Below the gateway: what a server serves is built here and handed to it as `Backend`s; nothing here knows gRPC, the
HTTP API or the canary. `build(BuildOptions(...))` is the entry point `tandem serve` calls.
"""

from __future__ import annotations

from tandem.engines.backend import Backend, ModelLimits, display_name, engine_lanes
from tandem.engines.options import Arm, BuildOptions, ClusterOptions, LocalOptions

__all__ = ["Arm", "Backend", "BuildOptions", "ClusterOptions", "LocalOptions", "ModelLimits", "build",
           "display_name", "engine_lanes"]


def build(options: BuildOptions) -> dict[str, Backend]:
    """{arm name: Backend} in the order of options.arms (the first the baseline). Blocking: models load and
    workers start here, so a server runs it off its event loop. Over Ray pools, start Ray first (engines.cluster.
    start_ray) on the main thread: started from another thread, Ray's own SIGTERM handler would take over. With a
    calibration file, arms whose costs it holds skip calibration (engines.calibration_file)."""
    if options.calibration_file:
        from tandem.engines.calibration_file import build_reusing

        return build_reusing(options, _build)
    return _build(options)


def _build(options: BuildOptions) -> dict[str, Backend]:
    if isinstance(options.placement, ClusterOptions):
        from tandem.engines.cluster import build_cluster_backends  # Ray: imported only where pools are built

        return build_cluster_backends(options.target, options.arms, options.placement, options.lanes)
    from tandem.engines.local import build_local_backends

    return build_local_backends(options.target, options.arms, options.placement)
