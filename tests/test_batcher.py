"""CallBatcher: concurrent calls merged into one run, each caller answered with its own rows."""

from __future__ import annotations

import threading
import time

from tandem.workers.batcher import CallBatcher
from tandem.workers.worker_base import WorkerReply


def test_concurrent_calls_share_forwards_and_get_their_own_rows() -> None:
    runs: list[list[int]] = []

    def run(requests: list[int]) -> WorkerReply:
        runs.append(list(requests))
        time.sleep(0.05)  # a forward long enough for the other callers to queue behind it
        return WorkerReply(results=[r * 10 for r in requests])

    batcher = CallBatcher(run, window_s=0.01)
    replies: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda i=i: replies.__setitem__(i, batcher.submit([i, i + 100]).results))
               for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert replies == {i: [i * 10, (i + 100) * 10] for i in range(6)}
    assert len(runs) < 6 and batcher.stats.merged >= 1
    assert batcher.stats.rows == 12 and batcher.stats.calls == 6


def test_a_merged_call_with_lost_rows_is_rerun_call_by_call() -> None:
    def run(requests: list[str]) -> WorkerReply:
        lost = [r for r in requests if r.startswith("lost")]
        time.sleep(0.02)
        return WorkerReply(lost=lost) if lost else WorkerReply(results=[r.upper() for r in requests])

    batcher = CallBatcher(run, window_s=0.05)
    replies: dict[str, WorkerReply] = {}
    threads = [threading.Thread(target=lambda r=r: replies.__setitem__(r, batcher.submit([r])))
               for r in ("ok", "lost-1")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert replies["ok"].results == ["OK"] and replies["ok"].lost is None
    assert replies["lost-1"].lost == ["lost-1"] and replies["lost-1"].results is None


def test_a_refused_row_is_answered_to_its_own_call_and_the_calls_merged_with_it_run_again() -> None:
    runs: list[list[str]] = []

    def run(requests: list[str]) -> WorkerReply:
        runs.append(list(requests))
        time.sleep(0.05)
        refused = next((r for r in requests if r.startswith("bad")), None)
        return WorkerReply(refused=(refused, f"{refused}: no")) if refused else WorkerReply(
            results=[r.upper() for r in requests])

    batcher = CallBatcher(run, window_s=0.05)
    replies: dict[str, WorkerReply] = {}
    threads = [threading.Thread(target=lambda r=r: replies.__setitem__(r[0], batcher.submit(r)))
               for r in (["ok", "fine"], ["bad", "mate"], ["also"])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert replies["ok"].results == ["OK", "FINE"] and replies["also"].results == ["ALSO"]
    assert replies["bad"].refused == ("bad", "bad: no") and replies["bad"].results is None
    # One merged forward, then the calls beside the refused one, each alone; the refused call is not run again.
    assert len(runs[0]) == 5 and sorted(runs[1:]) == [["also"], ["ok", "fine"]]


def test_a_failing_forward_raises_in_every_caller_it_served() -> None:
    def run(requests: list[int]) -> WorkerReply:
        time.sleep(0.02)
        raise RuntimeError("device lost")

    batcher = CallBatcher(run, window_s=0.05)
    errors: list[str] = []

    def call() -> None:
        try:
            batcher.submit([1])
        except RuntimeError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=call) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == ["device lost"] * 3


def test_a_worker_runs_its_model_on_one_thread_whoever_calls(tiny_dirs, monkeypatch) -> None:
    """Loading, forwards led by any of the call threads, and releases all run on the worker's model thread (one
    OpenMP team: see the batcher's docstring)."""
    from tandem.core.config import SamplingParams
    from tandem.core.protocol import DraftRequest
    from tandem.workers import draft_worker
    from tandem.workers.worker_base import WorkerConfig

    threads: set[str] = set()
    load_runner = draft_worker.load_runner

    def recording_load(*args):
        threads.add(threading.current_thread().name)
        return load_runner(*args)

    monkeypatch.setattr(draft_worker, "load_runner", recording_load)

    class Recording(draft_worker.DraftWorker):
        def _run(self, requests):
            threads.add(threading.current_thread().name)
            return super()._run(requests)

        def _release(self, seq_ids, retain):
            threads.add(threading.current_thread().name)
            super()._release(seq_ids, retain)

    worker = Recording(WorkerConfig(model=str(tiny_dirs.draft), device="cpu", dtype="float32"))
    params = SamplingParams(temperature=0.0, max_tokens=8)
    callers = [threading.Thread(target=lambda i=i: worker.propose([DraftRequest(f"s{i}", 0, [3, 4, 5 + i], 2,
                                                                                params)]))
               for i in range(4)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    worker.release([f"s{i}" for i in range(4)])
    assert worker.batcher.stats.forwards >= 1 and not worker.sequence_ids()
    assert len(threads) == 1 and next(iter(threads)).startswith("tandem-model")
