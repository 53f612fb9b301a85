"""Following workers' starts from outside the pool manager (`tandem pools start` and `scale`): each change of state
reported as it happens, a line a minute while one lasts, a clear error for a start that failed or one that waits
past the caller's time.

The waiting is the caller's, not the manager's: the manager answers `progress` at once, so an operator can stop or
correct a scale (another `tandem pools scale`) while an earlier one still waits for room on the cluster.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import ray

from tandem.errors import TandemError, WorkerStartFailed

POLL_S = 0.5
# Ray places a worker a moment after it is asked for: "pending" is news only once it lasts (no node has room).
PENDING_NEWS_S = 5.0
STILL_EVERY_S = 60.0
PROGRESS_TIMEOUT_S = 30.0  # the manager answers `progress` at once: past this it is gone or stuck


def wait_ready(manager, pool: str, names: list[str], timeout_s: float, report: Callable[[str], None],
               on_timeout: str = "") -> None:
    """Return once every named worker is ready or was stopped meanwhile (a later scale down). Raises
    WorkerStartFailed with the worker's own error when one fails, and a TandemError when some still start after
    `timeout_s` (0: return at once). `on_timeout` ends that error's message: what becomes of the workers."""
    started, seen, last_said = time.monotonic(), dict.fromkeys(names, ""), time.monotonic()
    while names and timeout_s > 0:
        states = _progress(manager, names, started + timeout_s)
        now = time.monotonic()
        if states is None:  # the manager is restarting: it adopts its workers and answers again
            time.sleep(POLL_S)
            continue
        for name in names:
            state = states[name]
            if state["state"] == "failed":
                raise WorkerStartFailed(state["error"])
            if state["state"] == "pending" and now - started < PENDING_NEWS_S:
                continue
            if state["state"] != seen[name]:
                seen[name], last_said = state["state"], now
                report(f"pools {pool}: {name} {describe(state, now - started)}")
        names = [n for n in names if states[n]["state"] not in ("ready", "stopped")]
        if names and now - started >= timeout_s:
            waiting = "; ".join(f"{n} {describe(states[n], now - started)}" for n in names)
            raise TandemError(f"pools {pool}: still starting after {timeout_s:g} s: {waiting}" +
                              (f". {on_timeout}" if on_timeout else ""))
        if names and now - last_said >= STILL_EVERY_S:
            last_said = now
            report(f"pools {pool}: still waiting ({now - started:.0f} s) for " +
                   ", ".join(f"{n} ({states[n]['state']})" for n in names))
        if names:
            time.sleep(POLL_S)


def _progress(manager, names: list[str], deadline: float) -> dict | None:
    """The manager's `progress`; None while it restarts (Ray restarts a manager whose node or process died, and it
    adopts its workers), until `deadline`."""
    try:
        return ray.get(manager.progress.remote(names), timeout=PROGRESS_TIMEOUT_S)
    except ray.exceptions.ActorUnavailableError:
        if time.monotonic() >= deadline:
            raise TandemError("the pools' manager is restarting and did not answer in time; `tandem pools status` "
                              "shows where the workers stand once it does") from None
        return None
    except ray.exceptions.RayActorError:
        raise TandemError("the pools' manager is gone (stopped, or died for good): `tandem pools status`") from None


def describe(state: dict, elapsed_s: float) -> str:
    """One worker's state in words."""
    if state["state"] == "pending":
        asks, free = _resources(state["asks"]), _resources(state["available"], keys=state["asks"])
        return (f"pending: Ray has placed it on no node yet; it asks for {asks} and the cluster has {free} free "
                f"(it starts once a node has room: an autoscaler may be adding one)")
    if state["state"] == "ready":
        return f"ready after {elapsed_s:.0f} s"
    if state["state"] == "stopped":
        return "stopped before it was ready (scaled down, or the pools stopped)"
    return state["state"]


def _resources(amounts: dict[str, float], keys: dict[str, float] | None = None) -> str:
    shown = {key: amounts.get(key, 0.0) for key in (keys if keys is not None else amounts)}
    return ", ".join(f"{key} {value:g}" for key, value in sorted(shown.items())) or "nothing"
