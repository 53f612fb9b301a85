"""The two roles of a speculative round, as messages and protocols.

The engine tells each side how many tokens of its copy of a sequence are still valid (`keep`) and which committed
tokens follow (`append`); workers never need the whole history again unless they lost it. A sequence released with
`retain` keeps its cache for the next request of its session, which may share a prefix with it. Greedy proposals
carry no distribution; sampled ones carry the exact truncated distribution each token was drawn from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tandem.core.config import SamplingParams
from tandem.core.sampling import SparseDist


class StateLost(RuntimeError):
    """A worker no longer holds (enough of) these sequences; the engine resends their whole history."""

    def __init__(self, seq_ids: list[str]) -> None:
        super().__init__(f"state lost for {len(seq_ids)} sequence(s)")
        self.seq_ids = seq_ids


class KVCacheFull(RuntimeError):
    """A worker's KV token budget cannot hold these sequences, even after dropping every retained session. Raised
    before the forward that would not fit writes anything: the call can be repeated once others have finished."""

    def __init__(self, needed: int, capacity: int) -> None:
        super().__init__(f"KV cache full: needs {needed} tokens of a budget of {capacity}")
        self.needed, self.capacity = needed, capacity

    def __reduce__(self):  # Ray and multiprocessing pickle it back with both fields
        return type(self), (self.needed, self.capacity)


@dataclass(slots=True, frozen=True)
class KVUsage:
    """KV cache tokens of a runner, or summed over a pool's workers: `used` hold keys and values (running sequences
    and retained sessions), `reserved` is what the caches have room for (slots x capacity, allocated or about to
    be), `capacity` the budget."""

    used: int = 0
    reserved: int = 0
    capacity: int = 0

    def __add__(self, other: KVUsage) -> KVUsage:
        return KVUsage(self.used + other.used, self.reserved + other.reserved, self.capacity + other.capacity)

    @classmethod
    def of(cls, runner) -> KVUsage:
        """A ModelRunner's figures (core.runner)."""
        return cls(runner.kv_tokens_used, runner.kv_tokens_reserved, runner.kv_tokens_capacity)

    @classmethod
    def from_info(cls, info: dict) -> KVUsage:
        """From a worker's info() (workers.worker_base)."""
        return cls(info["kv_tokens_used"], info["kv_tokens_reserved"], info["kv_tokens_capacity"])


class DrafterUnavailable(RuntimeError):
    """The drafter failed or timed out; the engine continues these sequences with plain decoding."""


@dataclass(slots=True)
class DraftRequest:
    seq_id: str
    keep: int
    append: list[int]
    k: int
    params: SamplingParams
    session: str = ""  # a new sequence may start from this session's retained cache


@dataclass(slots=True)
class DraftProposal:
    tokens: list[int]
    dist: SparseDist | None = None
    failed: bool = False  # the worker for this sequence failed: an empty proposal, decoded plainly this round


@dataclass(slots=True)
class VerifyRequest:
    seq_id: str
    keep: int
    append: list[int]
    draft: DraftProposal | None
    params: SamplingParams
    session: str = ""
    prefill_limit: int = 0  # cache at most this many uncached tokens this call; score only if none are left (0: no cap)


@dataclass(slots=True)
class VerifyResult:
    accepted: int
    next_token: int  # PREFILLING: the sequence's prefill was capped by prefill_limit and goes on next call

    @property
    def prefilling(self) -> bool:
        return self.next_token == PREFILLING


PREFILLING = -1


class Drafter(Protocol):
    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]: ...

    def release(self, seq_id: str, retain: bool = False) -> None: ...

    def kv_usage(self) -> KVUsage: ...


class Verifier(Protocol):
    vocab_size: int

    def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]: ...

    def release(self, seq_id: str, retain: bool = False) -> None: ...

    def kv_usage(self) -> KVUsage: ...
