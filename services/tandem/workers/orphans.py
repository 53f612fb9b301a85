"""Sequences whose gateway died: a shared pool's worker releases them.

A gateway that exits cleanly releases its sequences; one that is killed (SIGKILL, its node lost) leaves them on the
workers, holding KV cache that no one will use again. Every gateway is a Ray driver, that is a job of its own, and
its sequence ids on the wire start with `job-<job id>/` (owner_tag). A worker asks the GCS now and then which of the
jobs owning its sequences are dead, and releases their sequences.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Protocol

OWNER_PREFIX = "job-"
CHECK_EVERY_S = 10.0

log = logging.getLogger(__name__)


class SequenceHolder(Protocol):
    def sequence_ids(self) -> list[str]: ...

    def owns_sequences(self) -> bool: ...

    def release(self, seq_ids: list[str], retain: bool = False) -> None: ...


def owner_tag() -> str:
    """This process's wire-id prefix: its Ray job (Ray must be initialised)."""
    import ray

    return f"{OWNER_PREFIX}{ray.get_runtime_context().get_job_id()}/"


def owner_of(seq_id: str) -> str | None:
    if not seq_id.startswith(OWNER_PREFIX) or "/" not in seq_id:
        return None
    return seq_id[len(OWNER_PREFIX):seq_id.index("/")]


def orphans(seq_ids: Iterable[str], dead_jobs: set[str]) -> list[str]:
    return [seq_id for seq_id in seq_ids if owner_of(seq_id) in dead_jobs]


def dead_jobs() -> set[str]:
    """The jobs the GCS marks dead (a driver that exited or lost its connection)."""
    from ray._private import state

    return {job["JobID"] for job in state.jobs() if job["IsDead"]}


def release_orphans_forever(holder: SequenceHolder, every_s: float = CHECK_EVERY_S) -> None:
    """A worker's background loop; it only asks the GCS while it holds sequences of some gateway."""
    import ray

    while True:
        time.sleep(every_s)
        try:
            if not ray.is_initialized() or not holder.owns_sequences():
                continue
            held = holder.sequence_ids()
            if not any(owner_of(seq_id) for seq_id in held):
                continue
            lost = orphans(held, dead_jobs())
            if lost:
                log.warning("releasing %d sequence(s) of gateways that died", len(lost))
                holder.release(lost)
        except Exception:  # the GCS briefly unreachable: try again next time
            log.exception("could not look for sequences of dead gateways")
