"""Background responses (the Responses API's `background: true`): the request is answered at once with the response
`queued`, and the generation runs on here, whoever is connected. Its state is stored as it changes (queued, then
in_progress, then completed, incomplete, failed or cancelled; GET /v1/responses/{id} reads it on any gateway replica),
every event goes to its log (gateway.openai.response_log: a stream that `GET ...?stream=true&starting_after=N` reads
from any sequence number), and POST /v1/responses/{id}/cancel stops it: directly on this replica, through the log's
cancel flag from another, which the runner looks at every CANCEL_POLL_S.

A background response still counts against its tenant's concurrency cap and the queue while it runs, and a gateway
that drains lets it finish within the grace period like any request; one still running when the gateway stops is
stored as failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass

from tandem.gateway.openai.errors import OpenAIError, bad_request, from_exception, response_not_found
from tandem.gateway.openai.response_log import ResponseLog
from tandem.gateway.openai.responses_input import ResponsesTurn
from tandem.gateway.openai.responses_output import ResponseWriter, failed_events, output_of
from tandem.gateway.openai.stored import ResponseStore, StoredResponse, tenant_key

log = logging.getLogger(__name__)

Finished = Callable[[dict], Awaitable[None]]  # given a response that ended

CANCEL_POLL_S = 0.25  # how often a runner asks the log whether another replica cancelled it
CANCEL_WAIT_S = 5.0  # how long a cancel sent to another replica's response waits for that replica to stop it
HEARTBEAT_S, LEASE_S = 2.0, 10.0  # a runner renews its lease every HEARTBEAT_S; LEASE_S without one: it died
TERMINAL = frozenset({"completed", "incomplete", "failed", "cancelled"})
FINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})  # (cancelled has none)
SHUT_DOWN = OpenAIError(503, "the server shut down before this background response finished; create it again",
                        "server_error")
LOST = {"code": "server_error", "message": "the gateway replica running this background response stopped before it "
                                          "finished; create it again"}


@dataclass(slots=True)
class _Run:
    task: asyncio.Task
    shutting_down: bool = False
    lost: bool = False  # its lease ran out and another replica stored it failed: nothing more of it is written
    # Storing its last state: a cancel or a shutdown waits for that rather than interrupting it (interrupted, the
    # write went on in its thread while the shutdown closed the store under it, and the response stayed in_progress).
    ending: bool = False


class BackgroundResponses:
    """The background responses this replica runs, over the shared store and log."""

    def __init__(self, stored: ResponseStore, events: ResponseLog,
                 ended: Callable[[str], None] | None = None) -> None:
        """ended: told the status of each response that ends here (the gateway's metrics)."""
        self.stored, self.events, self.ended = stored, events, ended
        self._runs: dict[str, _Run] = {}  # store key -> its run, while it runs here

    async def start(self, tenant: str, writer: ResponseWriter, turn: ResponsesTurn, generation: AsyncGenerator,
                    admitted: asyncio.Event, renames: dict[str, str], finished: Finished | None = None) -> dict:
        """Store the response queued, start generating it, and return it as stored once the engine's queue has taken
        it (`admitted`, which `generation` sets): what refuses it there (a full queue, its tenant's caps, an invalid
        request) is raised, nothing kept, as for a request answered whole; stored queued, it failed later with no
        retry-later for its client. `finished` is given the response once it has ended, before it is stored so (a
        conversation takes its output then)."""
        key = tenant_key(tenant, writer.id)
        opening = writer.opening()
        queued = writer.response()
        try:
            await self.stored.create(tenant, StoredResponse(queued, turn.items, turn.after))  # refused: the id in use
        except OpenAIError:
            await generation.aclose()
            raise
        first = asyncio.ensure_future(anext(generation))  # prepared and queued, then the first event
        try:
            await _until_admitted(first, admitted)
        except BaseException:  # refused, or the client gone meanwhile (then every await of ours is cancelled)
            await asyncio.shield(self._abandon(tenant, writer.id, first, generation))
            raise
        await self.events.renew_lease(key, LEASE_S, new=True)
        await self.events.append(key, opening)
        task = asyncio.create_task(self._run(tenant, key, writer, turn, _after(first, generation), renames,
                                             finished), name=f"background-{writer.id}")
        self._runs[key] = _Run(task)
        task.add_done_callback(lambda _: self._runs.pop(key, None))
        return queued

    async def _abandon(self, tenant: str, response_id: str, first: asyncio.Future, generation: AsyncGenerator) -> None:
        first.cancel()
        with contextlib.suppress(BaseException):
            await first
        await generation.aclose()
        await self.stored.delete(tenant, response_id)

    async def _run(self, tenant: str, key: str, writer: ResponseWriter, turn: ResponsesTurn,
                   generation: AsyncGenerator, renames: dict[str, str], finished: Finished | None) -> None:
        kept_at = time.monotonic()
        keeping = asyncio.Lock()  # the run's and the watcher's puts in turn: the later holds the newer state

        async def keep() -> None:
            nonlocal kept_at
            async with keeping:
                kept_at = time.monotonic()
                await self.stored.put(tenant, StoredResponse(writer.response(), turn.items, turn.after))

        async def keep_if_due() -> None:  # also while no event comes (queued, a long prompt): the record's TTL
            if time.monotonic() - kept_at > self.stored.ttl_s / 2:
                await keep()

        watcher = asyncio.create_task(self._watch(key, asyncio.current_task(), keep_if_due))
        try:
            async with contextlib.aclosing(generation):
                async for event in generation:
                    if not writer.started:
                        started = writer.start()
                        await keep()
                        await self.events.append(key, started)
                    await self.events.append(key, writer.add(event))
                    await keep_if_due()  # a run longer than the record's TTL
            closing = writer.closing()
        except asyncio.CancelledError:
            run = self._runs.get(key)
            if run is not None and run.lost:
                return
            closing = writer.failed(SHUT_DOWN) if run is not None and run.shutting_down else writer.cancel()
        except Exception as exc:  # any failure is the response's: stored as failed, never raised
            closing = writer.failed(from_exception(exc, renames))
        finally:
            watcher.cancel()
        if (run := self._runs.get(key)) is not None:
            run.ending = True
        if self.ended is not None:  # (counted before it is seen ended)
            self.ended(writer.status())
        try:
            if finished is not None:
                await finished(writer.response())
            await keep()  # before the last event: a client that continues it at once finds it
            await self.events.append(key, closing)
        finally:
            await self.events.end(key)

    async def _watch(self, key: str, runner: asyncio.Task | None, keep_if_due: Callable[[], Awaitable[None]]) -> None:
        """Beside a run: cancel it when another replica asks, renew its lease, and store it again before its record's
        TTL runs out."""
        renewed = time.monotonic()
        while runner is not None and not runner.done():
            await asyncio.sleep(CANCEL_POLL_S)
            await keep_if_due()
            if await self.events.cancel_requested(key):
                runner.cancel()
                return
            if time.monotonic() - renewed >= HEARTBEAT_S:
                if not await self.events.renew_lease(key, LEASE_S):  # this replica stalled past its lease
                    if (run := self._runs.get(key)) is not None:
                        run.lost = True
                    runner.cancel()
                    return
                renewed = time.monotonic()

    async def current(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The stored response; one its replica left unfinished (its lease ran out) stored failed first."""
        found = await self.stored.get(tenant, response_id)
        if found is None or not found.response.get("background") or found.response["status"] in TERMINAL:
            return found
        key = tenant_key(tenant, response_id)
        if key in self._runs or await self.events.lease_held(key):
            return found
        return await self._ended(tenant, found, "failed", LOST)

    async def _ended(self, tenant: str, found: StoredResponse, status: str, error: dict | None = None
                     ) -> StoredResponse:
        """A response no runner will finish, stored as `status` by this replica with the output its log holds (its
        runner stored it only at its start and every TTL/2), and its log ended as a runner would have ended it."""
        key = tenant_key(tenant, found.response["id"])
        if not await self.events.claim_end(key):  # another replica ends it
            return await self.stored.get(tenant, found.response["id"]) or found
        logged = await self.events.logged(key)
        if logged:
            found.response["output"] = output_of(logged)
        found.response.update(status=status, error=error)
        await self.stored.put(tenant, found)
        if status == "failed":
            await self.events.append(key, failed_events(found.response, logged[-1]["sequence_number"] + 1 if logged
                                                        else 0))
        await self.events.end(key)
        return found

    async def cancel(self, tenant: str, response_id: str) -> dict:
        """POST /v1/responses/{id}/cancel: the response once stopped (a finished one as it is); 404 unknown, 400 not
        a background one."""
        found = await self._found(tenant, response_id)
        response = found.response
        if not response.get("background"):
            raise bad_request("Cannot cancel a synchronous response: only responses created with background true can "
                              "be cancelled.")
        if response["status"] in TERMINAL:
            return response
        key = tenant_key(tenant, response_id)
        if (run := self._runs.get(key)) is not None:
            if not run.ending:
                run.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(run.task)
            return (await self._found(tenant, response_id)).response
        await self.events.request_cancel(key)  # running on another replica: its runner sees the flag
        deadline = time.monotonic() + CANCEL_WAIT_S
        while time.monotonic() < deadline and await self.events.lease_held(key):
            await asyncio.sleep(CANCEL_POLL_S / 2)
            found = await self._found(tenant, response_id)
            if found.response["status"] in TERMINAL:
                return found.response
        # No runner stopped it: the replica running it is gone (it died without storing a last state).
        return (await self._ended(tenant, found, "cancelled")).response

    async def delete(self, tenant: str, response_id: str) -> bool:
        """DELETE /v1/responses/{id}: one still running is stopped first (else its runner stored it again as it went
        on, and it kept the engine busy); False where there is none."""
        found = await self.current(tenant, response_id)
        if found is None:
            return False
        if found.response.get("background") and found.response["status"] not in TERMINAL:
            await self.cancel(tenant, response_id)
        return await self.stored.delete(tenant, response_id)

    async def stream(self, tenant: str, response_id: str, after: int) -> AsyncGenerator[dict, None]:
        """The events of a background response with a sequence number above `after`, to its last; 404 unknown, 400
        not a background one."""
        found = await self._found(tenant, response_id)
        if not found.response.get("background"):
            raise bad_request("Only a response created with background true can be streamed again.", "stream")
        return self._replay(tenant, response_id, after)

    async def _replay(self, tenant: str, response_id: str, after: int) -> AsyncGenerator[dict, None]:
        """The log's events; where it ends with no last event (its runner died), the response is ended here (or by
        another replica) and its log read on to the events that say so."""
        key, last, final = tenant_key(tenant, response_id), after, False
        async for event in self.events.read(key, after):
            last, final = event["sequence_number"], event["type"] in FINAL_EVENTS
            yield event
        if not final and await self.current(tenant, response_id) is not None:
            async for event in self.events.read(key, last):
                yield event

    async def _found(self, tenant: str, response_id: str) -> StoredResponse:
        found = await self.current(tenant, response_id)
        if found is None:
            raise response_not_found(response_id)
        return found

    @property
    def running(self) -> int:
        return len(self._runs)

    async def close(self) -> None:
        """At shutdown, after the drain: what still runs is stored as failed (its clients may create it again)."""
        runs = list(self._runs.values())
        for run in runs:
            run.shutting_down = True
            if not run.ending:
                run.task.cancel()
        for run in runs:
            with contextlib.suppress(asyncio.CancelledError):
                await run.task
        if runs:
            log.warning("%d background response(s) still running at shutdown were stored as failed", len(runs))
        await self.events.close()


async def _until_admitted(first: asyncio.Future, admitted: asyncio.Event) -> None:
    """Wait until the request is in the engine's queue; raise what refused it before."""
    waiting = asyncio.ensure_future(admitted.wait())
    try:
        await asyncio.wait([first, waiting], return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiting.cancel()
    if not admitted.is_set() and first.done() and not isinstance(first.exception(), StopAsyncIteration):
        first.result()


async def _after(first: asyncio.Future, generation: AsyncGenerator) -> AsyncGenerator:
    """The generation's events: `first`'s (already asked for), then the rest; closing it closes the generation."""
    async with contextlib.aclosing(generation):
        try:
            yield await first
        except StopAsyncIteration:
            return
        async for event in generation:
            yield event
