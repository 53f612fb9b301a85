"""Batches (OpenAI's Batch API): a file of requests run by the gateway replicas, whoever is connected, into an
output file and an error file (gateway.openai.batch_input for the lines, gateway.openai.files for the files).

Each request goes through the gateway's own HTTP API in process, as the tenant that created the batch (a scope key no
client can send; the tenant's key must still be accepted), so it is validated, admitted, counted and answered exactly
as the same request sent by a client; a 429 or 503 is sent again after a backoff. A replica runs up to `concurrency`
requests of its batches at once (--batch-concurrency), behind its clients' requests (gateway.validate's
BACKGROUND_PRIORITY: a client's request takes a batch request's place in the engine's next step); one given 0 stores
the batches it is sent and leaves them to the replicas that run batches.

A batch is claimed by one replica at a time, under a lease its run renews (gateway.openai.batch_run, which keeps what
is answered as it goes). A replica that shuts down lets its batches go; one that dies lets its lease run out. Every
replica looks at the running batches every SWEEP_S and claims one nobody holds, going on from what was kept: a
rolling restart of the gateways pauses a batch, it does not fail it. The batch object is stored as it changes
(in_progress with its request counts, cancelling, finalizing, then completed, cancelled or expired), so GET
/v1/batches/{id} reads it on any replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable

from tandem.gateway.openai import batch_run
from tandem.gateway.openai.batch_input import jsonl, not_run, read_requests
from tandem.gateway.openai.batch_run import BatchRun
from tandem.gateway.openai.errors import OpenAIError, bad_request
from tandem.gateway.openai.files import FileStore
from tandem.gateway.openai.files import not_found as file_not_found
from tandem.gateway.openai.records import TenantRecords
from tandem.gateway.openai.stored import store_beside
from tandem.sessions import StoreUnavailable

log = logging.getLogger(__name__)

BATCH_PREFIX = "tandem:batch:"
MAX_IN_MEMORY = 1024
CONCURRENCY = 8  # the default of requests of a replica's batches in flight at once, all batches together
SWEEP_S = 2.0  # how often a replica looks for batches nobody holds
CLAIMABLE = frozenset({"in_progress", "cancelling", "finalizing"})
COMPLETION_WINDOW_S = 24 * 3600  # "24h", the one window OpenAI offers
ENDED = {"cancelled": "cancelled", "expired": "expired", "input_gone": "failed", None: "completed"}
INPUT_GONE = {"object": "list", "data": [{"code": "input_file_gone", "param": "input_file_id", "line": None,
                                          "message": "The batch's input file is gone: it cannot go on."}]}
RUNNING_INDEX = "running"


def not_found(batch_id: str) -> OpenAIError:
    return OpenAIError(404, f"No batch found with id '{batch_id}'.", param="batch_id")


class Batches:
    """The batches of every replica (in `records`), and the runs of those this replica holds."""

    def __init__(self, records: TenantRecords, files: FileStore, ended: Callable[[str], None] | None = None,
                 concurrency: int = CONCURRENCY) -> None:
        """ended: told the status of each batch that ends here (the gateway's metrics); concurrency: requests of
        batches this replica runs at once (0: it runs none)."""
        self.records, self.files, self.ended = records, files, ended
        self.concurrency = concurrency
        self._runs: dict[tuple[str, str], BatchRun] = {}
        self._slots = asyncio.Semaphore(max(1, concurrency))
        self._app = None
        self._sweeper: asyncio.Task | None = None

    def bind(self, app) -> None:
        """The ASGI app the requests go through: this gateway's own."""
        self._app = app

    def start(self) -> None:
        """Begin looking for batches nobody holds (on the event loop, once the app is bound), unless this replica
        runs none."""
        if self.concurrency > 0:
            self._sweeper = asyncio.create_task(self._sweep(), name="batch-sweeper")

    async def create(self, tenant: str, input_file_id: str, endpoint: str, metadata: dict[str, str],
                     output_expires_in: int | None = None) -> dict:
        """output_expires_in: seconds its output and error files live (output_expires_after; None: as files do)."""
        try:
            purpose = (await self.files.get(tenant, input_file_id))["purpose"]
            content = await self.files.content(tenant, input_file_id)
        except OpenAIError:
            raise file_not_found(input_file_id, "input_file_id") from None
        if purpose != "batch":  # another batch's output, say
            raise bad_request(f"input_file_id: {input_file_id} has purpose {purpose!r}; a batch reads a file "
                              "uploaded with purpose 'batch'", "input_file_id")
        requests, errors = await asyncio.to_thread(read_requests, content, endpoint)
        now = int(time.time())
        batch = {"id": self.records.new_id(), "object": "batch", "endpoint": endpoint, "errors": None,
                 "input_file_id": input_file_id, "completion_window": "24h", "status": "in_progress",
                 "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": now,
                 "expires_at": now + COMPLETION_WINDOW_S, "finalizing_at": None, "completed_at": None,
                 "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                 "request_counts": {"total": len(requests), "completed": 0, "failed": 0}, "metadata": metadata}
        record = {"batch": batch, "lease_until": 0.0, "owner": "", "chunks": [], "done": [],
                  "output_expires_in": output_expires_in}
        if errors:  # refused whole, as OpenAI's validation does
            batch.update(status="failed", in_progress_at=None, failed_at=now, errors={"object": "list", "data": errors},
                         request_counts={"total": 0, "completed": 0, "failed": 0})
            await self.records.add(tenant, batch["id"], record)
            self._ended("failed")
            return batch
        run = self._run_of(tenant, record, requests)
        if self.concurrency > 0:
            record.update(owner=run.run_id, lease_until=time.time() + batch_run.LEASE_S)
        await self.records.add(tenant, batch["id"], record)
        await self.records.update_shared(RUNNING_INDEX, lambda index: _indexed(index, [tenant, batch["id"]]))
        if self.concurrency > 0:  # (else it waits, unowned, for a replica that runs batches)
            self._go(run)
        return batch

    def _run_of(self, tenant: str, record: dict, requests: list, run_id: str | None = None) -> BatchRun:
        batch = record["batch"]
        run = BatchRun(tenant, batch["id"], batch["endpoint"], batch["expires_at"], requests, set(record["done"]),
                       dict(batch["request_counts"]), self.records)
        if run_id is not None:
            run.run_id = run_id
        return run

    def _go(self, run: BatchRun) -> None:
        key = (run.tenant, run.batch_id)
        self._runs[key] = run
        workers = min(self.concurrency, len(run.requests) - len(run.done)) or 1
        run.task = asyncio.create_task(self._going(run, workers), name=f"batch-{run.batch_id}")
        run.task.add_done_callback(lambda _: self._runs.pop(key, None))

    async def _going(self, run: BatchRun, workers: int) -> None:
        try:
            await run.go(self._app, self._slots, workers, self._finish)
        except StoreUnavailable as exc:  # its lease runs out, and a replica's sweep takes it on once Redis answers
            log.warning("batch %s: stopped, its state could not be kept (%s)", run.batch_id, exc)

    async def _finish(self, run: BatchRun) -> None:
        """Write the files from every run's kept results and end the batch (as this run's, else nothing)."""
        tenant, batch_id = run.tenant, run.batch_id
        record = await self._change(run, status="finalizing", finalizing_at=int(time.time()))
        if record is None:
            return
        chunks = [await self.records.get(tenant, chunk) for chunk in record["chunks"]]
        results: dict[int, tuple[bool, dict]] = {}
        for chunk in chunks:
            for index, ok, line in (chunk or {}).get("results", []):
                results.setdefault(index, (ok, line))
        if run.stop == "expired":
            for index, request in enumerate(run.requests):
                results.setdefault(index, (False, not_run(request.custom_id, "batch_expired",
                                                          "This request was not run before the batch expired.")))
        files = {}
        for name, wanted in (("output", True), ("error", False)):
            lines = [line for _, (ok, line) in sorted(results.items()) if ok is wanted]
            if lines:
                content = await asyncio.to_thread(jsonl, lines)
                files[f"{name}_file_id"] = (await self.files.create(tenant, f"{batch_id}_{name}.jsonl",
                                                                    "batch_output", content,
                                                                    record.get("output_expires_in")))["id"]
        status = ENDED[run.stop]
        if run.stop == "input_gone":
            files["errors"] = INPUT_GONE
        if await self._change(run, status=status, **{f"{status}_at": int(time.time())}, **files) is None:
            return
        # Counted as it is stored ended, which any replica may read at once; the cleanup after is the store's.
        self._ended(status)
        for chunk in record["chunks"]:
            await self.records.discard(tenant, chunk)
        await self.records.update_shared(RUNNING_INDEX, lambda index: _unindexed(index, [tenant, batch_id]))

    async def _change(self, run: BatchRun, **changes) -> dict | None:
        """Change the batch object, provided the batch is still `run`'s; the record after, or None."""
        ours = {}

        def change(record: dict) -> None:
            ours["yes"] = record.get("owner") == run.run_id
            if ours["yes"]:
                record["batch"].update(changes, request_counts=dict(run.counts))
                record["lease_until"] = time.time() + batch_run.LEASE_S

        record = await self.records.update(run.tenant, run.batch_id, change)
        return record if record is not None and ours.get("yes") else None

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                index = await self.records.get_shared(RUNNING_INDEX)
                for tenant, batch_id in (index or {}).get("running", []):
                    if (tenant, batch_id) in self._runs:
                        continue
                    record = await self.records.get(tenant, batch_id)  # (a read: no transaction while it is held)
                    if record is None or record["batch"]["status"] not in CLAIMABLE \
                            or record["lease_until"] <= time.time():
                        await self._claim(tenant, batch_id)
            except Exception:  # (a Redis outage: the next sweep tries again)
                log.exception("looking for batches to go on with failed")

    async def _claim(self, tenant: str, batch_id: str) -> None:
        """Go on with a batch nobody holds (its replica shut down or died), if it is one."""
        run_id = uuid.uuid4().hex

        def claim(record: dict) -> None:
            if record["batch"]["status"] in CLAIMABLE and record["lease_until"] <= time.time():
                record.update(owner=run_id, lease_until=time.time() + batch_run.LEASE_S)

        record = await self.records.update(tenant, batch_id, claim)
        if record is None or record["batch"]["status"] not in CLAIMABLE:  # gone, or ended: no longer running
            await self.records.update_shared(RUNNING_INDEX, lambda index: _unindexed(index, [tenant, batch_id]))
            return
        if record["owner"] != run_id:
            return
        batch = record["batch"]
        try:
            content = await self.files.content(tenant, batch["input_file_id"])
        except OpenAIError:
            content = ""
        requests, errors = await asyncio.to_thread(read_requests, content, batch["endpoint"])
        run = self._run_of(tenant, record, requests, run_id)
        if errors:  # its input file expired or was deleted meanwhile: failed, with the answers it has in its files
            run.stop = "input_gone"
            await self._finish(run)
            return
        log.info("going on with batch %s (%d of %d requests answered)", batch_id, len(run.done), len(requests))
        if batch["status"] == "in_progress":
            self._go(run)
            return
        run.stop = "cancelled" if batch["cancelling_at"] else "expired" if time.time() >= run.expires_at else None
        await self._finish(run)

    def _ended(self, status: str) -> None:
        if self.ended is not None:
            self.ended(status)

    async def current(self, tenant: str, batch_id: str) -> dict:
        record = await self.records.get(tenant, batch_id) if self.records.is_id(batch_id) else None
        if record is None:
            raise not_found(batch_id)
        return record["batch"]

    async def listing(self, tenant: str) -> list[dict]:
        return [record["batch"] for record in await self.records.all(tenant)]

    async def cancel(self, tenant: str, batch_id: str) -> dict:
        """POST /v1/batches/{id}/cancel: the batch `cancelling` (its run stops at its next beat, on any replica)."""
        batch = await self.current(tenant, batch_id)
        if batch["status"] in ("completed", "failed", "expired"):
            raise bad_request(f"Cannot cancel a batch with status '{batch['status']}'.")

        def cancelling(record: dict) -> None:
            if record["batch"]["status"] == "in_progress":
                record["batch"].update(status="cancelling", cancelling_at=int(time.time()))

        record = await self.records.update(tenant, batch_id, cancelling)
        if (run := self._runs.get((tenant, batch_id))) is not None:
            run.wake.set()
        return record["batch"] if record is not None else batch

    @property
    def running(self) -> int:
        return len(self._runs)

    async def close(self) -> None:
        """At shutdown: stop looking, and let go of the batches running here (another replica goes on with them)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        tasks = [run.task for run in self._runs.values() if run.task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if tasks:
            log.warning("let go of %d running batch(es) at shutdown: another replica goes on with them", len(tasks))


def _indexed(index: dict | None, entry: list[str]) -> dict:
    running = (index or {}).get("running", [])
    return {"running": running if entry in running else [*running, entry]}


def _unindexed(index: dict | None, entry: list[str]) -> dict | None:
    running = [other for other in (index or {}).get("running", []) if other != entry]
    return {"running": running} if running else None


def batch_ttl(response_ttl_s: float) -> float:
    """How long files and batches are kept after their last write: --response-ttl past the longest a batch runs, so
    a batch's input and what it kept outlast it."""
    return response_ttl_s + COMPLETION_WINDOW_S if response_ttl_s > 0 else 0.0


def open_batches(sessions: object, response_ttl_s: float, files: FileStore,
                 ended: Callable[[str], None] | None = None, concurrency: int = CONCURRENCY) -> Batches:
    """Batches beside `sessions` (in its Redis when it is one), their files in `files`."""
    store = store_beside(sessions, batch_ttl(response_ttl_s), BATCH_PREFIX, MAX_IN_MEMORY)
    return Batches(TenantRecords(store, "batch", "batch_"), files, ended, concurrency)
