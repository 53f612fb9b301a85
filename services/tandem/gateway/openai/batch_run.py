"""One batch run by one replica, from where the batch stands: its requests not yet answered are sent, and what is
answered is kept as it goes, so that another replica (or this one again) goes on from there if this one stops.

Every HEARTBEAT_S the run writes the results answered since the last beat as a chunk of their own (a record named by
the run, so a run that lost its claim cannot overwrite another's chunk), then in one atomic change of the batch record
adds that chunk, marks its requests done, stores the counts and renews its lease, provided the batch is still its
own. The beat is also where it learns of a cancel, of the window's end, or that another replica claimed it.
Requests in flight when a run stops are sent again by the next (a request is answered at least once; its line is in
the files once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from tandem.gateway.openai.batch_input import BATCH_TENANT, BatchRequest, answered, not_run
from tandem.gateway.openai.records import TenantRecords

log = logging.getLogger(__name__)

HEARTBEAT_S, LEASE_S = 1.0, 10.0  # a run renews its lease every HEARTBEAT_S; LEASE_S without, it is claimable
RETRY_FIRST_S, RETRY_MAX_S = 0.25, 5.0  # a 429 or 503 is sent again after this, doubling up to the most

Result = tuple[int, bool, dict]  # (request index, answered 2xx, its line)


def chunk_id(batch_id: str, run_id: str, number: int) -> str:
    return f"{batch_id}/results/{run_id}/{number}"


@dataclass(slots=True)
class BatchRun:
    """A claimed batch's run: `requests` all of the batch's, `done` the indices answered before this run."""

    tenant: str
    batch_id: str
    endpoint: str
    expires_at: int
    requests: list[BatchRequest]
    done: set[int]
    counts: dict
    records: TenantRecords
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    fresh: list[Result] = field(default_factory=list)  # answered since the last beat
    chunks_written: int = 0
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    stop: str | None = None  # "cancelled", "expired", "shutdown", or "lost" (another run holds it)
    task: asyncio.Task | None = None

    async def go(self, app, slots: asyncio.Semaphore, workers: int,
                 finish: Callable[[BatchRun], Awaitable[None]]) -> None:
        """Send what is not done, beating until all is answered or the run stops; then `finish` it (unless it was
        lost, or this replica shuts down: then its lease is let go, for another replica to go on)."""
        pending = iter([index for index in range(len(self.requests)) if index not in self.done])

        async def scoped(scope, receive, send):  # the creator's tenant, which no client's request can set
            await app({**scope, BATCH_TENANT: self.tenant}, receive, send)

        async def work(client: httpx.AsyncClient) -> None:
            for index in pending:
                async with slots:
                    ok, line = await self._send(client, index)
                self.fresh.append((index, ok, line))
                self.counts["completed" if ok else "failed"] += 1

        transport = httpx.ASGITransport(app=scoped, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://tandem-batch", timeout=None) as client:
            running = asyncio.gather(*(work(client) for _ in range(workers)))
            running.add_done_callback(lambda _: self.wake.set())
            try:
                while not running.done() and self.stop is None:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.wake.wait(), HEARTBEAT_S)
                    self.wake.clear()
                    try:
                        await self.beat()
                    except Exception:  # (the store failed this once: what was answered waits for the next beat)
                        log.exception("batch %s: keeping what was answered failed", self.batch_id)
            except asyncio.CancelledError:
                self.stop = self.stop or "shutdown"
            finally:
                running.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await running
        if self.stop == "shutdown":
            await self.beat(release=True)
        elif self.stop != "lost" and await self.beat():
            await finish(self)

    async def _send(self, client: httpx.AsyncClient, index: int) -> tuple[bool, dict]:
        request, delay = self.requests[index], RETRY_FIRST_S
        while True:
            try:
                response = await client.post(self.endpoint, json=request.body)
            except Exception as exc:  # (the app answers its own errors; this is the transport's) one line, not all
                log.exception("batch %s: request %r failed", self.batch_id, request.custom_id)
                return False, not_run(request.custom_id, "server_error", f"the request failed: {type(exc).__name__}")
            if response.status_code not in (429, 503):
                break
            await asyncio.sleep(delay)
            delay = min(2 * delay, RETRY_MAX_S)
        try:
            body = response.json()
        except ValueError:
            body = response.text
        request_id = response.headers.get("x-request-id") or (body.get("id") if isinstance(body, dict) else None)
        return response.is_success, answered(request.custom_id, response.status_code, request_id or "", body)

    async def beat(self, release: bool = False) -> bool:
        """Keep what was answered since the last beat and renew the lease (`release`: give it up instead); False,
        and `stop` "lost", when the batch is no longer this run's. Notices a cancel and the window's end."""
        # The counts of just these results: one a worker adds while this beat waits is kept by the next beat, so
        # counts and done indices always agree (a run going on from them counts no request twice).
        fresh, self.fresh, counts = self.fresh, [], dict(self.counts)
        try:
            return await self._keep(fresh, counts, release)
        except BaseException:
            self.fresh[:0] = fresh  # (kept by the next beat, in a chunk of another name)
            raise

    async def _keep(self, fresh: list[Result], counts: dict, release: bool) -> bool:
        chunk = None
        if fresh:
            chunk = chunk_id(self.batch_id, self.run_id, self.chunks_written)
            self.chunks_written += 1
            await self.records.put(self.tenant, chunk, {"results": fresh})
        state = {}

        def change(record: dict) -> None:
            state["ours"] = record.get("owner") == self.run_id
            if not state["ours"]:
                return
            if chunk is not None:
                record["chunks"].append(chunk)
                record["done"].extend(index for index, _, _ in fresh)
            record["batch"]["request_counts"] = counts
            record["lease_until"] = 0.0 if release else time.time() + LEASE_S
            record["owner"] = "" if release else self.run_id
            state["status"] = record["batch"]["status"]

        record = await self.records.update(self.tenant, self.batch_id, change)
        if record is None or not state.get("ours"):
            self.stop = "lost"
            return False
        if state["status"] == "cancelling":
            self.stop = self.stop or "cancelled"
        elif time.time() >= self.expires_at:
            self.stop = self.stop or "expired"
        return True
