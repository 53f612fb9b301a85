"""Serving engine lanes: a gateway's requests split over several engines on the same pools, so drafting overlaps
verifying (the engines are built by tandem.engines.backend.engine_lanes).

One engine runs its rounds in order: draft, then verify, then the next draft. With the drafter and the verifier on
separate hardware (draft workers on small GPUs, target replicas on large ones) each side idles while the other
works. Lanes split a gateway's requests over N engines, each with its own thread and its own pool clients (its own
wire-id prefix: to the workers, a lane is one more gateway), so while lane A's rows are being verified, lane B's rows
are being drafted. The workers merge calls that reach them at the same time (workers.batcher), so lanes in step
still share forwards. Every lane shares one cost model and one acceptance prior (the measured costs are the same
hardware's).

A request goes to the first lane with room in its batch, and to the least loaded only when every lane is full:
splitting a batch that one engine could run costs more than the overlap gives back wherever a forward over half the
rows costs much more than half a full one (measured on the real pair: the target's busy time per token rose 1.4x
with 8 sessions split 4 + 4, docs/performance.md), so a second lane takes sessions only beyond one engine's
--max-batch.

`LanedLoop` has the interface the gateway uses of an `EngineLoop` (submit, cancel, draining, active, ...).
"""

from __future__ import annotations

from tandem.core.serving_engine import ServingEngine
from tandem.errors import InvalidArgument, request_id_in_use
from tandem.gateway.handles import RequestHandle, Submission, check_room
from tandem.gateway.loop import EngineLoop


class LanedLoop:
    def __init__(self, loops: list[EngineLoop], max_requests: int) -> None:
        if len(loops) < 2:
            raise InvalidArgument(f"lanes: a laned loop needs at least two lanes, got {len(loops)}")
        self.lanes = loops
        self.max_requests = max_requests

    @property
    def engine(self) -> ServingEngine:
        """The first lane's engine: the lanes share its configuration, costs and prior."""
        return self.lanes[0].engine

    @property
    def draining(self) -> bool:
        return any(lane.draining for lane in self.lanes)

    @draining.setter
    def draining(self, value: bool) -> None:
        for lane in self.lanes:
            lane.draining = value

    @property
    def active(self) -> int:
        return sum(lane.active for lane in self.lanes)

    @property
    def unavailable(self) -> bool:
        return any(lane.unavailable for lane in self.lanes)

    @property
    def waiting_for_replica(self) -> bool:
        return any(lane.waiting_for_replica for lane in self.lanes)

    def recover(self, timeout_s: float) -> bool:
        return all([lane.recover(timeout_s) for lane in self.lanes])

    def probe_idle(self, timeout_s: float) -> None:
        for lane in self.lanes:
            lane.probe_idle(timeout_s)

    @property
    def batch_capacity(self) -> int:
        return sum(lane.batch_capacity for lane in self.lanes)

    @property
    def stalled(self) -> bool:
        return any(lane.stalled for lane in self.lanes)

    def sessions_in_fallback(self) -> int:
        return sum(lane.sessions_in_fallback() for lane in self.lanes)

    def preemptions(self) -> dict[str, int]:
        counts = [lane.preemptions() for lane in self.lanes]
        return {kind: sum(count[kind] for count in counts) for kind in counts[0]}

    async def start(self) -> None:
        for lane in self.lanes:
            await lane.start()

    def end_requests(self) -> None:
        for lane in self.lanes:
            lane.end_requests()

    async def close(self) -> None:
        for lane in self.lanes:
            await lane.close()

    async def submit(self, request: Submission) -> RequestHandle:
        if any(lane.has_request(request.request_id) for lane in self.lanes):
            raise request_id_in_use(request.request_id)
        check_room(self.active, sum(lane.unread for lane in self.lanes), self.max_requests)
        serving = [lane for lane in self.lanes if not lane.unavailable and not lane.waiting_for_replica] or self.lanes
        with_room = [candidate for candidate in serving if candidate.active < candidate.batch_capacity]
        lane = with_room[0] if with_room else min(serving, key=lambda candidate: candidate.active)
        return await lane.submit(request)

    def cancel(self, request_id: str, detach: bool = False) -> bool:
        return any(lane.cancel(request_id, detach) for lane in self.lanes)


ServingLoop = EngineLoop | LanedLoop  # what the gateway drives: one engine, or lanes of them
