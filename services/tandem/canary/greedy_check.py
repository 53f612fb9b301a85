"""Greedy-equality checks for draft canaries: a sampled share of greedy sessions is re-run as plain decoding of the
same target, and the canary's output must match it token for token (speculative decoding is exact).

The gateway supplies the plain path as a `PlainReference`: `reference(prompt_ids, n)` returns the first n tokens of
plain greedy decoding (no stops, EOS ignored). `loop_reference` builds one from a gateway EngineLoop (a request with
max_k=0), `engine_reference` from an in-process SpeculativeEngine.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from tandem.canary.arms import ArmSpec
from tandem.canary.assignment import session_point
from tandem.core.config import SamplingParams
from tandem.errors import InvalidArgument

log = logging.getLogger(__name__)

PlainReference = Callable[[list[int], int], list[int]]
SAMPLE_SALT = "tandem-canary-greedy-check"


def plain_params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


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


def engine_reference(engine) -> PlainReference:
    """Plain greedy decoding (max_k=0) on an in-process SpeculativeEngine; call it only while nothing else steps it."""

    def reference(prompt_ids: list[int], n: int) -> list[int]:
        request_id = engine.add_request(prompt_ids, plain_params(n), f"canary-check-{uuid.uuid4().hex}", max_k=0)
        seq = engine.sequences[request_id]
        while request_id in engine.sequences:
            engine.step()
        return list(seq.output)

    return reference


def loop_reference(engine_loop, event_loop: asyncio.AbstractEventLoop, timeout_s: float = 120.0) -> PlainReference:
    """Plain greedy decoding through a gateway EngineLoop (`submit(..., max_k=0)`), callable from any thread but the
    event loop's own (the checker's background thread)."""

    async def run(prompt_ids: list[int], n: int) -> list[int]:
        request_id = f"canary-check-{uuid.uuid4().hex}"
        handle = await engine_loop.submit(prompt_ids, plain_params(n), request_id, session_id="", max_k=0)
        tokens: list[int] = []
        finished = False
        try:
            async for update in handle:
                tokens.extend(update.token_ids)
                finished = update.finished is not None
        finally:
            if not finished:
                engine_loop.cancel(request_id, detach=True)
        return tokens

    def reference(prompt_ids: list[int], n: int) -> list[int]:
        future = asyncio.run_coroutine_threadsafe(run(prompt_ids, n), event_loop)
        try:
            return future.result(timeout_s)
        except BaseException:
            future.cancel()  # a timeout: cancel the request (its `finally` frees the sequence) and give up
            raise

    return reference
