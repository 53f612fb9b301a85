"""Session-to-worker routing shared by the draft pool and the target replicas.

A running sequence sticks to the worker that holds its KV cache. A new sequence of a known session goes back to the
worker that retained the session's cache (its previous turn), unless that worker is busier than the least loaded
one by more than `max_imbalance` sequences; other new sequences go to the least loaded healthy worker. A worker
that fails is benched for a cool-down and its sequences and sessions are routed afresh.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict

log = logging.getLogger(__name__)

MAX_SESSIONS = 100_000


class AffinityRouter:
    def __init__(self, size: int, cooldown_s: float, role: str, max_imbalance: int = 2) -> None:
        if size < 1:
            raise ValueError(f"a {role} pool needs at least one worker")
        self.size, self.cooldown_s, self.role = size, cooldown_s, role
        self.max_imbalance = max_imbalance
        self.affinity: dict[str, int] = {}  # running sequence -> worker
        self.session_of: dict[str, str] = {}  # running sequence -> its session
        self.sessions: OrderedDict[str, int] = OrderedDict()  # session -> worker that retained its last sequence
        self.benched_until = [0.0] * size
        self.rerouted = 0
        self.session_hits = 0

    def healthy(self, index: int) -> bool:
        return time.monotonic() >= self.benched_until[index]

    def route(self, seq_id: str, session: str = "") -> int | None:
        index = self.affinity.get(seq_id)
        if index is not None and self.healthy(index):
            return index
        candidates = [i for i in range(self.size) if self.healthy(i)]
        if not candidates:
            return None
        load = Counter(self.affinity.values())
        choice = min(candidates, key=lambda i: (load[i], i))
        preferred = self.sessions.get(session) if session and index is None else None
        if preferred is not None and self.healthy(preferred) and load[preferred] <= load[choice] + self.max_imbalance:
            choice = preferred
            self.session_hits += 1
        self.rerouted += index is not None
        self.affinity[seq_id] = choice
        if session:
            self.session_of[seq_id] = session
        return choice

    def group(self, keys: list[tuple[str, str]]) -> dict[int | None, list[int]]:
        """Row numbers per worker index (None: no healthy worker), for (sequence, session) pairs."""
        groups: dict[int | None, list[int]] = {}
        for row, (seq_id, session) in enumerate(keys):
            groups.setdefault(self.route(seq_id, session), []).append(row)
        return groups

    def bench(self, index: int, why: str) -> list[str]:
        """Take a worker out for the cool-down; returns the sequences it held."""
        log.warning("%s worker %d %s; benched for %.0f s", self.role, index, why, self.cooldown_s)
        self.benched_until[index] = time.monotonic() + self.cooldown_s
        held = [s for s, i in self.affinity.items() if i == index]
        for seq_id in held:
            del self.affinity[seq_id]
        for session in [s for s, i in self.sessions.items() if i == index]:
            del self.sessions[session]
        return held

    def forget(self, seq_id: str, retained: bool = False) -> int | None:
        """A sequence ended; with `retained`, its worker keeps the cache for the session's next sequence."""
        index = self.affinity.pop(seq_id, None)
        session = self.session_of.pop(seq_id, "")
        if retained and session and index is not None:
            self.pin(session, index)
        return index

    def pin(self, session: str, index: int) -> None:
        """Route the session's next sequence to `index` (its cache, or state loaded from the session store)."""
        if not 0 <= index < self.size:
            return
        self.sessions.pop(session, None)
        self.sessions[session] = index
        while len(self.sessions) > MAX_SESSIONS:
            self.sessions.popitem(last=False)
