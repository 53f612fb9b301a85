"""Session-to-worker routing shared by the draft pool and the target replicas.

A session sticks to the worker that holds its KV cache; new sessions go to the least loaded healthy worker. A
worker that fails is benched for a cool-down and its sessions are routed afresh.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

log = logging.getLogger(__name__)


class AffinityRouter:
    def __init__(self, size: int, cooldown_s: float, role: str) -> None:
        if size < 1:
            raise ValueError(f"a {role} pool needs at least one worker")
        self.size, self.cooldown_s, self.role = size, cooldown_s, role
        self.affinity: dict[str, int] = {}
        self.benched_until = [0.0] * size
        self.rerouted = 0

    def healthy(self, index: int) -> bool:
        return time.monotonic() >= self.benched_until[index]

    def route(self, seq_id: str) -> int | None:
        index = self.affinity.get(seq_id)
        if index is not None and self.healthy(index):
            return index
        candidates = [i for i in range(self.size) if self.healthy(i)]
        if not candidates:
            return None
        load = Counter(self.affinity.values())
        choice = min(candidates, key=lambda i: (load[i], i))
        self.rerouted += index is not None
        self.affinity[seq_id] = choice
        return choice

    def group(self, seq_ids: list[str]) -> dict[int | None, list[int]]:
        """Row numbers per worker index (None: no healthy worker)."""
        groups: dict[int | None, list[int]] = {}
        for row, seq_id in enumerate(seq_ids):
            groups.setdefault(self.route(seq_id), []).append(row)
        return groups

    def bench(self, index: int, why: str) -> list[str]:
        """Take a worker out for the cool-down; returns the sessions it held."""
        log.warning("%s worker %d %s; benched for %.0f s", self.role, index, why, self.cooldown_s)
        self.benched_until[index] = time.monotonic() + self.cooldown_s
        held = [s for s, i in self.affinity.items() if i == index]
        for seq_id in held:
            del self.affinity[seq_id]
        return held

    def forget(self, seq_id: str) -> int | None:
        return self.affinity.pop(seq_id, None)
