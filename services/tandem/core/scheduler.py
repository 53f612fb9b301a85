"""Which sequences a step runs, and which gives its KV caches up when the verifier is full: the engine's one place
that decides what runs next.

A step runs the first max_batch sequences in priority order (lower first; equal ones in arrival order), so a request
of a lower value takes the place of one of a higher value at the next step, which waits with its caches kept. While
the verifier is full, a waiting sequence runs only if it comes before one the verifier holds, and the last of the step
(the lowest priority, newest) gives its caches up to make room. A worker shared with other gateways or lanes frees
their sequences that come after every row of a call in that same order (workers.kv_order); a step's one row that
other callers' sequences ahead of it keep out waits for them (KVCacheFull.ahead), retrying, and sequences left waiting
by such a worker try again every RETRY_SHARED_FULL_STEPS steps (the others finishing tell this engine nothing).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from tandem.core.protocol import KVCacheFull
from tandem.core.requests import Sequence
from tandem.errors import KVBudgetExceeded

# A step whose one row waits for other callers' sequences at a full worker sleeps before the next try: from 5 ms,
# doubling, to a quarter second (each try is one call that the worker refuses before running anything).
FIRST_WAIT_S, MAX_WAIT_S = 0.005, 0.25
# Steps after which sequences a shared worker's full cache left waiting try again: a retry that still does not fit
# costs a call the worker refuses before any forward.
RETRY_SHARED_FULL_STEPS = 16


class Scheduler:
    def __init__(self, max_batch: int, drop_caches: Callable[[Sequence], None]) -> None:
        """drop_caches: has the workers drop a sequence's caches (it is resent its whole history when it resumes)."""
        self.max_batch = max_batch
        self.drop_caches = drop_caches
        self._kv_full = False  # the verifier was full: sequences it does not hold wait until one finishes
        # ...or, where other callers' sequences filled it too (KVCacheFull.ahead), until they may have left.
        self._shared_full_steps: int | None = None
        # Sequences taken out of the steps they ran in: "priority" (left out for a lower value, their caches kept),
        # "kv" (their caches given up to a full verifier: recomputed when they resume). Fixed keys: read from other
        # threads (metrics).
        self.preemptions = {"priority": 0, "kv": 0}
        self._stepped: set[str] = set()  # the last step's sequences
        self._waits = 0  # steps in a row that waited for other callers' sequences to leave a full worker

    def schedule(self, sequences: Iterable[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        """This step's batch, and every sequence that may run in priority order (the batch first)."""
        waiting = sorted(sequences, key=_priority)  # stable: equal priorities in arrival order
        if self._kv_full and self._shared_full_steps is not None:
            self._shared_full_steps += 1
            self._kv_full = self._shared_full_steps < RETRY_SHARED_FULL_STEPS
        if self._kv_full:
            waiting = _while_full(waiting)
        return waiting[: self.max_batch], waiting

    def make_room(self, batch: list[Sequence], waiting: list[Sequence], full: KVCacheFull) -> list[Sequence]:
        """The batch to try again after `full`: the caches of the last sequence the verifier holds freed (the lowest
        priority, newest): one the step left out (a higher priority took its place), else the step's own last, which
        goes back to waiting. A sequence alone that does not fit, nothing else held, never will: KVBudgetExceeded
        names it (the caller fails that request, not the others); one that other callers' sequences ahead of it keep
        out waits (an empty batch: `wait`, then the next step)."""
        self._kv_full = True
        self._shared_full_steps = 0 if full.ahead else None
        if left_out := [seq for seq in waiting[len(batch):] if seq.admitted]:
            self._drop(left_out[-1])
            return batch
        if len(batch) == 1:
            if full.ahead:  # a shared worker's other callers hold the rest, ahead of this row (workers.kv_order)
                return []
            raise KVBudgetExceeded(batch[0].request_id, full.needed, full.capacity) from full
        self._drop(batch[-1])
        return batch[:-1]

    def wait(self) -> None:
        """No row of the step fits beside other callers' sequences: back off before the next try."""
        self._waits += 1
        time.sleep(min(MAX_WAIT_S, FIRST_WAIT_S * 2 ** min(self._waits, 8)))

    def ran(self, batch: list[Sequence], waiting: list[Sequence]) -> None:
        """The step ran `batch`: count the sequences of the last step it left out for a lower priority."""
        self._waits = 0
        self.preemptions["priority"] += sum(seq.admitted for seq in waiting[len(batch):] if seq.request_id in
                                            self._stepped)
        self._stepped = {seq.request_id for seq in batch}

    def _drop(self, seq: Sequence) -> None:
        self.preemptions["kv"] += seq.admitted
        self.drop_caches(seq)


def _priority(seq: Sequence) -> int:
    return seq.priority


def _while_full(waiting: list[Sequence]) -> list[Sequence]:
    """The sequences a full verifier may run: those it holds, and those waiting before the last of them by priority
    (the step makes room for them by deferring its last); none held: the first waiting alone."""
    held = [seq.priority for seq in waiting if seq.admitted]
    if not held:
        return waiting[:1]
    last = max(held)
    return [seq for seq in waiting if seq.admitted or seq.priority < last]
