"""Batches (OpenAI's Batch API): a file of requests run by the gateway replica that took it, whoever is connected,
into an output file and an error file (gateway.openai.batch_input for the lines, gateway.openai.files for the files).

Each request goes through this gateway's own HTTP API in process (httpx's ASGI transport, with the creator's API key),
so it is validated, admitted, counted and answered exactly as the same request sent by a client; a 429 or 503 (the
queue or the tenant's cap full, the server loading) is sent again after a backoff. A replica runs up to CONCURRENCY
requests of its batches at once, beside its clients' requests (with no priority below them).

The batch object is stored as it changes (in_progress with its request counts, then finalizing, then completed,
cancelled, expired or failed), so GET /v1/batches/{id} reads it on any replica. The runner renews a lease with each
heartbeat: a batch whose replica stopped without finishing it is found failed by the next read. A cancel is stored
(`cancelling`) and seen by the runner at its next heartbeat on any replica; what finished is kept in the files. A
batch still running when its gateway shuts down ends failed with what finished in its files.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from tandem.gateway.openai.batch_input import BatchRequest, answered, jsonl, not_run, read_requests
from tandem.gateway.openai.errors import OpenAIError, bad_request
from tandem.gateway.openai.files import FileStore
from tandem.gateway.openai.records import TenantRecords
from tandem.gateway.openai.stored import store_beside

log = logging.getLogger(__name__)

BATCH_PREFIX = "tandem:batch:"
MAX_IN_MEMORY = 1024
RUNNING = frozenset({"validating", "in_progress", "finalizing", "cancelling"})
CONCURRENCY = 8  # requests of this replica's batches in flight at once, all batches together
HEARTBEAT_S, LEASE_S = 1.0, 10.0  # counts stored and the lease renewed every HEARTBEAT_S; LEASE_S without: it died
RETRY_FIRST_S, RETRY_MAX_S = 0.25, 5.0  # a 429 or 503 is sent again after this, doubling up to the most
COMPLETION_WINDOW_S = 24 * 3600  # "24h", the one window OpenAI offers
ENDED = {"cancelled": "cancelled", "expired": "expired", "shutdown": "failed", None: "completed"}


def not_found(batch_id: str) -> OpenAIError:
    return OpenAIError(404, f"No batch found with id '{batch_id}'.", param="batch_id")


def _error_list(code: str, message: str) -> dict:
    return {"object": "list", "data": [{"code": code, "message": message, "param": None, "line": None}]}


LOST = _error_list("server_error", "The gateway replica running this batch stopped before it finished; what it "
                                   "finished is lost. Create the batch again.")
SHUT_DOWN = _error_list("server_shutdown", "The gateway shut down before this batch finished; what finished is in "
                                           "its output and error files. Create a batch of the rest.")


@dataclass(slots=True)
class _Run:
    tenant: str
    batch: dict  # as created
    requests: list[BatchRequest]
    results: list[dict | None]
    succeeded: list[bool]
    counts: dict = field(default_factory=dict)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None
    stop: str | None = None  # "cancelled", "expired", "shutdown", or "lost" (another replica stored it failed)


class Batches:
    """The batches of every replica (in `records`), and the ones this replica runs."""

    def __init__(self, records: TenantRecords, files: FileStore, ended: Callable[[str], None] | None = None) -> None:
        """ended: told the status of each batch that ends here (the gateway's metrics)."""
        self.records, self.files, self.ended = records, files, ended
        self._runs: dict[tuple[str, str], _Run] = {}
        self._slots = asyncio.Semaphore(CONCURRENCY)
        self._app = None

    def bind(self, app) -> None:
        """The ASGI app the requests go through: this gateway's own."""
        self._app = app

    async def create(self, tenant: str, authorization: str | None, input_file_id: str, endpoint: str,
                     metadata: dict[str, str]) -> dict:
        try:
            content = await self.files.content(tenant, input_file_id)
        except OpenAIError:
            raise OpenAIError(404, f"No such File object: {input_file_id}", param="input_file_id") from None
        requests, errors = await asyncio.to_thread(read_requests, content, endpoint)
        now = int(time.time())
        batch = {"id": f"batch_{uuid.uuid4().hex}", "object": "batch", "endpoint": endpoint, "errors": None,
                 "input_file_id": input_file_id, "completion_window": "24h", "status": "in_progress",
                 "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": now,
                 "expires_at": now + COMPLETION_WINDOW_S, "finalizing_at": None, "completed_at": None,
                 "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                 "request_counts": {"total": len(requests), "completed": 0, "failed": 0}, "metadata": metadata}
        if errors:  # refused whole, as OpenAI's validation does
            batch.update(status="failed", in_progress_at=None, failed_at=now, errors={"object": "list", "data": errors},
                         request_counts={"total": 0, "completed": 0, "failed": 0})
            await self.records.add(tenant, batch["id"], {"batch": batch, "lease_until": 0})
            if self.ended is not None:
                self.ended("failed")
            return batch
        await self.records.add(tenant, batch["id"], {"batch": batch, "lease_until": time.time() + LEASE_S})
        run = _Run(tenant, batch, requests, [None] * len(requests), [False] * len(requests),
                   dict(batch["request_counts"]))
        key = (tenant, batch["id"])
        self._runs[key] = run
        run.task = asyncio.create_task(self._run(run, authorization), name=f"batch-{batch['id']}")
        run.task.add_done_callback(lambda _: self._runs.pop(key, None))
        return batch

    async def _run(self, run: _Run, authorization: str | None) -> None:
        headers = {"authorization": authorization} if authorization else {}
        transport = httpx.ASGITransport(app=self._app, raise_app_exceptions=False)
        pending = iter(range(len(run.requests)))

        async def work(client: httpx.AsyncClient) -> None:
            for index in pending:
                async with self._slots:
                    run.results[index], run.succeeded[index] = await self._send(client, headers, run, index)
                run.counts["completed" if run.succeeded[index] else "failed"] += 1

        async with httpx.AsyncClient(transport=transport, base_url="http://tandem-batch", timeout=None) as client:
            workers = asyncio.gather(*(work(client) for _ in range(min(CONCURRENCY, len(run.requests)))))
            workers.add_done_callback(lambda _: run.wake.set())
            try:
                while not workers.done() and run.stop is None:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(run.wake.wait(), HEARTBEAT_S)
                    run.wake.clear()
                    await self._heartbeat(run)
            except asyncio.CancelledError:
                run.stop = run.stop or "shutdown"
            finally:
                workers.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await workers
        if run.stop != "lost":
            await self._finish(run)

    async def _send(self, client: httpx.AsyncClient, headers: dict, run: _Run, index: int) -> tuple[dict, bool]:
        request, delay = run.requests[index], RETRY_FIRST_S
        while True:
            response = await client.post(run.batch["endpoint"], json=request.body, headers=headers)
            if response.status_code not in (429, 503):
                break
            await asyncio.sleep(delay)
            delay = min(2 * delay, RETRY_MAX_S)
        try:
            body = response.json()
        except ValueError:
            body = response.text
        request_id = response.headers.get("x-request-id") or (body.get("id") if isinstance(body, dict) else None)
        return answered(request.custom_id, response.status_code, request_id or "", body), response.is_success

    async def _heartbeat(self, run: _Run) -> None:
        """Store the counts and renew the lease; notice a cancel, the window's end, or a batch no longer ours."""
        def renew(record: dict) -> None:
            if record["batch"]["status"] in ("in_progress", "cancelling"):
                record["batch"]["request_counts"] = dict(run.counts)
                record["lease_until"] = time.time() + LEASE_S

        record = await self.records.update(run.tenant, run.batch["id"], renew)
        status = record["batch"]["status"] if record is not None else None
        if status == "cancelling":
            run.stop = "cancelled"
        elif status != "in_progress":
            run.stop = "lost"  # stored failed by a replica that found its lease run out, or expired
        elif time.time() >= run.batch["expires_at"]:
            run.stop = "expired"

    async def _finish(self, run: _Run) -> None:
        tenant, batch_id = run.tenant, run.batch["id"]
        await self._store(run, status="finalizing", finalizing_at=int(time.time()))
        outputs = [line for line, ok in zip(run.results, run.succeeded, strict=True) if line is not None and ok]
        errors = [line for line, ok in zip(run.results, run.succeeded, strict=True) if line is not None and not ok]
        if run.stop == "expired":
            errors += [not_run(request.custom_id, "batch_expired", "This request was not run before the batch "
                               "expired.") for request, line in zip(run.requests, run.results, strict=True)
                       if line is None]
        files = {}
        for name, lines in (("output", outputs), ("error", errors)):
            if lines:
                content = await asyncio.to_thread(jsonl, lines)
                files[f"{name}_file_id"] = (await self.files.create(tenant, f"{batch_id}_{name}.jsonl",
                                                                    "batch_output", content))["id"]
        status = ENDED[run.stop]
        await self._store(run, status=status, **{f"{status}_at": int(time.time())}, **files,
                          **({"errors": SHUT_DOWN} if run.stop == "shutdown" else {}))
        if self.ended is not None:
            self.ended(status)

    async def _store(self, run: _Run, **changes) -> None:
        def change(record: dict) -> None:
            record["batch"].update(changes, request_counts=dict(run.counts))
            record["lease_until"] = time.time() + LEASE_S

        await self.records.update(run.tenant, run.batch["id"], change)

    async def current(self, tenant: str, batch_id: str) -> dict:
        """The batch as stored; one its replica left unfinished (its lease ran out) stored failed first."""
        record = await self.records.get(tenant, batch_id)
        if record is None:
            raise not_found(batch_id)
        return await self._checked(tenant, record)

    async def _checked(self, tenant: str, record: dict) -> dict:
        batch = record["batch"]
        if batch["status"] not in RUNNING or (tenant, batch["id"]) in self._runs or record["lease_until"] > time.time():
            return batch

        def failed(stored: dict) -> None:
            if stored["batch"]["status"] in RUNNING and stored["lease_until"] <= time.time():
                stored["batch"].update(status="failed", failed_at=int(time.time()), errors=LOST)

        changed = await self.records.update(tenant, batch["id"], failed)
        if changed is not None and changed["batch"]["status"] == "failed" and self.ended is not None:
            self.ended("failed")
        return changed["batch"] if changed is not None else batch

    async def listing(self, tenant: str) -> list[dict]:
        return [await self._checked(tenant, record) for record in await self.records.all(tenant)]

    async def cancel(self, tenant: str, batch_id: str) -> dict:
        """POST /v1/batches/{id}/cancel: the batch `cancelling` (its runner stops at its next heartbeat)."""
        batch = await self.current(tenant, batch_id)
        if batch["status"] in ("completed", "failed", "expired"):
            raise bad_request(f"Cannot cancel a batch with status '{batch['status']}'.")

        def cancelling(record: dict) -> None:
            if record["batch"]["status"] == "in_progress":
                record["batch"].update(status="cancelling", cancelling_at=int(time.time()))

        record = await self.records.update(tenant, batch_id, cancelling)
        if (run := self._runs.get((tenant, batch_id))) is not None:
            run.wake.set()  # (one on another replica sees it at its next heartbeat)
        return record["batch"] if record is not None else batch

    @property
    def running(self) -> int:
        return len(self._runs)

    async def close(self) -> None:
        """At shutdown: what still runs ends failed, with what finished in its files."""
        tasks = [run.task for run in self._runs.values() if run.task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if tasks:
            log.warning("%d batch(es) still running at shutdown ended failed (what finished is in their files)",
                        len(tasks))


def open_batches(sessions: object, ttl_s: float, files: FileStore, ended: Callable[[str], None] | None = None
                 ) -> Batches:
    """Batches beside `sessions` (in its Redis when it is one), their files in `files`."""
    return Batches(TenantRecords(store_beside(sessions, ttl_s, BATCH_PREFIX, MAX_IN_MEMORY), "batch"), files, ended)
