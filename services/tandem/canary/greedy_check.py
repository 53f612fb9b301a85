"""Greedy-equality checks for draft canaries: a sampled share of greedy sessions is re-run as plain decoding of the
same target, and the canary's output must match it token for token (speculative decoding is exact).

The plain path is a `PlainReference`: `reference(prompt_ids, n)` returns the first n tokens of plain greedy decoding
(no stops, EOS ignored); the gateway supplies one over its baseline arm (tandem.gateway.arms.plain_decoder).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from tandem.canary.arms import ArmSpec
from tandem.canary.assignment import session_point
from tandem.errors import InvalidArgument

log = logging.getLogger(__name__)

PlainReference = Callable[[list[int], int], list[int]]
SAMPLE_SALT = "tandem-canary-greedy-check"


class GreedyChecker:
    """Decides which requests to check (greedy, a draft canary arm, a sampled session) and runs the checks, inline
    or on one background thread with at most `max_pending` waiting (more are skipped, never queued up)."""

    def __init__(self, reference: PlainReference, rate: float = 0.05, max_tokens: int = 64, max_pending: int = 2,
                 inline: bool = False, check_baseline: bool = False) -> None:
        if not 0.0 <= rate <= 1.0:
            raise InvalidArgument(f"greedy_check_rate: must be in [0, 1], got {rate}")
        if max_tokens < 1 or max_pending < 1:
            raise InvalidArgument("greedy_check_tokens: must be at least 1; max_pending: must be at least 1")
        self.reference, self.rate, self.max_tokens = reference, rate, max_tokens
        self.max_pending, self.inline, self.check_baseline = max_pending, inline, check_baseline
        self.skipped = 0  # checks dropped because max_pending were already waiting
        self._pending = 0
        self._lock = threading.Lock()
        self._pool = None if inline else ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-canary-check")

    def wants(self, key: str, greedy: bool, arm: ArmSpec, baseline: ArmSpec, secret: bytes = b"") -> bool:
        """Check this request? Greedy only; arms that decode with the baseline's target and may draft. Sessions are
        sampled at a point keyed with `secret` (the controller's), so clients cannot compute which ones are checked."""
        if not greedy or self.rate <= 0.0 or arm.enabled is False or arm.k_max == 0 or not arm.same_model_as(baseline):
            return False
        if arm.name == baseline.name and not self.check_baseline:
            return False
        return session_point(key, secret, SAMPLE_SALT) < self.rate

    def compare(self, prompt_ids: list[int], output_ids: list[int]) -> bool | None:
        """True when plain decoding gives the same tokens (up to max_tokens); None for an empty output."""
        n = min(len(output_ids), self.max_tokens)
        if n == 0:
            return None
        return list(self.reference(list(prompt_ids), n))[:n] == list(output_ids[:n])

    def submit(self, prompt_ids: list[int], output_ids: list[int], done: Callable[[bool], None]) -> bool:
        """Run a check; `done(match)` gets its result. False when skipped (too many pending)."""
        if self._pool is None:
            self._run(list(prompt_ids), list(output_ids), done)
            return True
        with self._lock:
            if self._pending >= self.max_pending:
                self.skipped += 1
                return False
            self._pending += 1
        self._pool.submit(self._run, list(prompt_ids), list(output_ids), done, True)
        return True

    def _run(self, prompt_ids: list[int], output_ids: list[int], done: Callable[[bool], None],
             pooled: bool = False) -> None:
        try:
            match = self.compare(prompt_ids, output_ids)
            if match is not None:
                done(match)
        except Exception:
            log.warning("canary greedy check failed to run; not counted", exc_info=True)
        finally:
            if pooled:
                with self._lock:
                    self._pending -= 1

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
