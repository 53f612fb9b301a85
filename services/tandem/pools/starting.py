"""Starting a pool's workers: the starting half of PoolManager (pools.manager).

Asking Ray for a worker returns at once, whether or not the cluster has room, so each start is waited for on a thread
of its own. A worker that loads joins the pool (a new generation, which gateways follow); one whose start fails is
stopped and its error kept for `progress` and `status` to report.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

import ray

from tandem.errors import TandemError
from tandem.pools.health import last_error
from tandem.pools.launch import Launched, await_started, launch

if TYPE_CHECKING:
    from tandem.pools.manager import PoolSpec
    from tandem.workers.tp_replica import TensorParallelReplica
    from tandem.workers.worker_base import WorkerConfig

log = logging.getLogger(__name__)

FAILURES_KEPT = 64  # the last starts that failed, by worker name, for `progress` and `status` to report


class WorkerStarts:
    """PoolManager's worker-starting methods; PoolManager sets the state below."""

    spec: PoolSpec
    draft_config: WorkerConfig | None
    workers: dict[str, dict[str, object]]
    starting: dict[str, Launched]
    failures: OrderedDict[str, dict]
    next_index: dict[str, int]
    groups: dict[str, TensorParallelReplica]
    generation: int
    _lock: threading.Lock
    _stopped: threading.Event

    def _begin(self, role: str, count: int) -> None:
        """Ask Ray for `count` more workers of `role` and wait for each on a thread of its own. Under the lock:
        asking returns at once, whether or not the cluster has room. Nothing once the pools are stopping."""
        for _ in range(0 if self._stopped.is_set() else count):
            index = self.next_index[role]
            self.next_index[role] = index + 1
            launched = launch(self.spec, self.draft_config, role, index)
            if launched.group is not None:
                self.groups[launched.name] = launched.group
            self._wait_for(launched)

    def _wait_for(self, launched: Launched) -> None:
        """List the worker as starting and wait for it on a thread of its own (`_await`)."""
        self.starting[launched.name] = launched
        threading.Thread(target=self._await, args=(launched,), name=f"tandem-pools-{launched.name}",
                         daemon=True).start()

    def _unexpected(self, launched: Launched, exc: BaseException) -> str:
        """An error of the worker's start that tandem did not word (a corrupt weights file, say): which worker, on
        which host, loading what, beside the error's own last line."""
        from tandem.workers.worker_base import worker_host

        config = self.spec.target if launched.role == "target" else self.spec.draft
        model = f"model {config.model}: " if config is not None else ""
        return f"a {launched.role} worker on {worker_host(str(exc))} could not start: {model}{last_error(exc)}"

    def _await(self, launched: Launched) -> None:
        """Wait for one worker's start; a ready worker joins the pool (a new generation: gateways follow), one whose
        start failed is stopped and its error kept. A worker stopped while it started (a scale down) ends quietly."""
        try:
            await_started(launched)
        except Exception as exc:
            from tandem.workers.worker_base import user_error

            with self._lock:
                if self.starting.pop(launched.name, None) is None:
                    return
                failed = exc if isinstance(exc, TandemError) else user_error(exc)
                message = str(failed) if failed is not None else self._unexpected(launched, exc)
                log.error("pools %s: %s could not start: %s", self.spec.name, launched.name, message)
                self.failures[launched.name] = {"role": launched.role, "error": message, "at": round(time.time())}
                while len(self.failures) > FAILURES_KEPT:
                    self.failures.popitem(last=False)
                self.groups.pop(launched.name, None)  # a tensor-parallel start that fails stops its own group
                for actor in launched.actors:
                    ray.kill(actor, no_restart=True)
            return
        with self._lock:
            if self.starting.pop(launched.name, None) is None:
                return  # stopped while it loaded: `_remove` has killed it
            self.workers[launched.role][launched.name] = launched.handle
            self.generation += 1
