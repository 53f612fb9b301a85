"""What the pool manager knows of its workers' health: each one's own report (`info`) within a short wait, and an
actor's state in Ray's actor table."""

from __future__ import annotations

import re

import ray

# Ray's actor states (gcs.proto ActorTableData.ActorState) of an actor whose constructor has not returned.
NOT_PLACED = frozenset({"DEPENDENCIES_UNREADY", "PENDING_CREATION"})
STATUS_TIMEOUT_S = 2.0  # a worker that has not answered `info` by then is reported unhealthy
STATUS_FIELDS = ("sequences", "retained_sessions", "retained_prefixes", "kv_tokens_used", "kv_tokens_capacity",
                 "reused_tokens", "shared_tokens", "forwards",
                 "rows", "merged_forwards", "busy_s", "pid", "threads", "metrics")  # copied from each worker's info()


def worker_health(workers: dict[str, dict[str, object]]) -> list[dict]:
    """Every serving worker's status ({role: {name: handle}}): its load, sessions and KV tokens where it answered in
    time, `healthy` False where it did not (dead, restarting, raising or busy past STATUS_TIMEOUT_S)."""
    out, refs = [], []
    for role, named in workers.items():
        for name, handle in named.items():
            out.append({"role": role, "name": name, "healthy": False, "state": "ready"})
            refs.append(handle.info.remote())
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=STATUS_TIMEOUT_S) if refs else ([], [])
    for worker, ref in zip(out, refs, strict=True):
        if ref not in ready:
            continue
        try:
            info = ray.get(ref)
        except ray.exceptions.RayError:  # dead, restarting or raising: unhealthy
            continue
        worker.update({key: info[key] for key in STATUS_FIELDS}, healthy=True,
                      rows_per_forward=round(info["rows_per_forward"], 3),
                      calls_per_forward=round(info["calls_per_forward"], 3),
                      evicted=info.get("evicted", 0),  # sequences freed for other callers' (workers.kv_order)
                      weights=info.get("weights", ""),  # "" from a worker older than the field, mid-rollout
                      gc_frozen_objects=info.get("gc_frozen_objects", 0))  # its loaded heap, out of collections
    return out


def succeeded(ref) -> bool:
    """Whether a finished call returned (not: its worker was restarting, raised, or is a tensor-parallel rank not set
    up yet)."""
    try:
        ray.get(ref)
    except ray.exceptions.RayError:
        return False
    return True


def actor_state(handle) -> str:
    """ALIVE, RESTARTING, DEAD, PENDING_CREATION, ... from the GCS's actor table; "" when it cannot be read."""
    return _actor_record(handle).get("State", "")


def actor_placed(handle) -> bool:
    """Whether Ray has given the actor a process. An actor stays PENDING_CREATION until its constructor returns (a
    worker loads its model there), so the state alone cannot tell "no node has room" from "loading": the process id
    can. True where the table cannot be read (nothing to report then)."""
    record = _actor_record(handle)
    return record.get("State", "") not in NOT_PLACED or record.get("Pid", 0) > 0


def _actor_record(handle) -> dict:
    """The actor's row in the GCS's actor table (Ray's public state API needs the dashboard, which a cluster may run
    without); {} when it cannot be read."""
    try:
        from ray._private import state

        return state.actors(handle._actor_id.hex())
    except Exception:
        return {}


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception)\w*: .*)$")


def last_error(exc: BaseException) -> str:
    """A failed start's cause in one line: the last `SomeError: message` line of Ray's remote traceback (a
    constructor's error reaches the manager only as that text), without its colour codes."""
    text = _ANSI.sub("", str(exc))
    lines = [match.group(1) for line in text.splitlines() if (match := _ERROR_LINE.match(line.strip()))]
    return lines[-1] if lines else f"{type(exc).__name__}: {text.strip().splitlines()[0] if text.strip() else ''}"
