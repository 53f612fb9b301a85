"""The two roles of a speculative round, as messages and protocols.

The engine tells each side how many tokens of its copy of a sequence are still valid (`keep`) and which committed
tokens follow (`append`); workers never need the whole history again unless they lost it. A sequence released with
`retain` keeps its cache for the next request of its session, which may share a prefix with it. Greedy proposals
carry no distribution; sampled ones carry the exact truncated distribution each token was drawn from.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from tandem.core.config import SamplingParams
from tandem.core.logprobs import TokenLogprob
from tandem.core.row_layout import RowLayout

if TYPE_CHECKING:
    import numpy as np


class StateLost(RuntimeError):
    """A worker no longer holds (enough of) these sequences; the engine resends their whole history."""

    def __init__(self, seq_ids: list[str]) -> None:
        super().__init__(f"state lost for {len(seq_ids)} sequence(s)")
        self.seq_ids = seq_ids


class KVCacheFull(RuntimeError):
    """A worker's KV token budget cannot hold these sequences, even after dropping every retained session. Raised
    before the forward that would not fit writes anything: the call can be repeated once others have finished.
    `ahead`: sequences of other callers (gateways, engine lanes) that come before this call's rows hold part of the
    budget (workers.kv_order), so the call may fit once they finish, though nothing of its caller's would free room."""

    def __init__(self, needed: int, capacity: int, ahead: bool = False) -> None:
        super().__init__(f"KV cache full: needs {needed} tokens of a budget of {capacity}")
        self.needed, self.capacity, self.ahead = needed, capacity, ahead

    def __reduce__(self):  # Ray and multiprocessing pickle it back with every field
        return type(self), (self.needed, self.capacity, self.ahead)


@dataclass(slots=True, frozen=True)
class WorkerLoad:
    """What a worker holds for every caller, as gateways place new sequences by it (workers.routing): its running
    sequences, the cached tokens of the longest, and its KV token budget (0: not known yet). The cache gives every
    sequence a slot as long as the longest (core.slots `_fit`); retained sessions' caches make way for new ones."""

    sequences: int
    longest: int = 0
    capacity: int = 0

    def reserved(self, sequences: int, tokens: int) -> int:
        """The KV tokens `sequences` running sequences, one of them `tokens` long, take here."""
        return sequences * max(tokens, self.longest)

    def fits(self, sequences: int, tokens: int) -> bool:
        """Whether `sequences` running sequences, one of them `tokens` long, fit the budget."""
        return not self.capacity or self.reserved(sequences, tokens) <= self.capacity

    def fill(self, sequences: int, tokens: int) -> float:
        """The share of the budget they take (0.0 while the budget is not known)."""
        return self.reserved(sequences, tokens) / self.capacity if self.capacity else 0.0


@dataclass(slots=True, frozen=True)
class KVUsage:
    """KV cache tokens of a runner, or summed over a pool's workers: `used` hold keys and values (running sequences
    and retained sessions), `reserved` is what the caches have room for (slots x capacity, allocated or about to
    be), `capacity` the budget; `shared`: prompt tokens new sequences copied from cached prefixes since the start
    (prefix caching: core.slots)."""

    used: int = 0
    reserved: int = 0
    capacity: int = 0
    shared: int = 0

    def __add__(self, other: KVUsage) -> KVUsage:
        return KVUsage(self.used + other.used, self.reserved + other.reserved, self.capacity + other.capacity,
                       self.shared + other.shared)

    @classmethod
    def of(cls, runner) -> KVUsage:
        """A ModelRunner's figures (core.runner)."""
        return cls(runner.kv_tokens_used, runner.kv_tokens_reserved, runner.kv_tokens_capacity, runner.shared_tokens)

    @classmethod
    def from_info(cls, info: dict) -> KVUsage:
        """From a worker's info() (workers.worker_base)."""
        return cls(info["kv_tokens_used"], info["kv_tokens_reserved"], info["kv_tokens_capacity"],
                   info.get("shared_tokens", 0))


@dataclass(slots=True, frozen=True, order=True)
class RowOrder:
    """Where a sequence stands at a worker whose KV cache is full (workers.kv_order): lower priority values first
    (the engine's step order), then earlier arrivals (wall-clock seconds: comparable across gateways)."""

    priority: int = 0
    arrival: float = 0.0

    @classmethod
    def now(cls) -> RowOrder:
        """A row of priority 0 that arrived now (calibration's, a probe's): behind every earlier one."""
        return cls(0, time.time())


@dataclass(slots=True)
class DraftRequest:
    seq_id: str
    keep: int
    append: list[int]
    k: int
    params: SamplingParams
    session: str = ""  # a new sequence may start from this session's retained cache
    output_start: int = 0  # where the request's output begins in the sequence: its penalties count from there
    cache_scope: str = ""  # only sequences of the same scope (a tenant) share cached prefixes
    order: RowOrder = field(default_factory=RowOrder.now)  # which sequences a full worker frees first


@dataclass(slots=True)
class DraftDist:
    """The truncated draft distributions a proposal's tokens were drawn from, on the host as numpy arrays: `ids`
    [k, m] int64 and `probs` [k, m] float32, each row summing to 1. numpy rather than torch: a proposal passes
    through the gateway from a draft worker to a target worker, and a gateway over shared pools imports no torch. The
    verifier turns them back into a core.sampling.SparseDist on its device."""

    ids: np.ndarray
    probs: np.ndarray


@dataclass(slots=True)
class DraftProposal:
    tokens: list[int]
    dist: DraftDist | None = None
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
    output_start: int = 0  # where the request's output begins in the sequence: its penalties count from there
    # Score every prompt token after the first too (params.prompt_logprobs alternatives): the sequence is new to the
    # verifier (keep 0, no session), and its prompt goes whole into the forward that scores its first round.
    score_prompt: bool = False
    cache_scope: str = ""  # only sequences of the same scope (a tenant) share cached prefixes
    order: RowOrder = field(default_factory=RowOrder.now)  # which sequences a full worker frees first
    # A plain row (no draft) may decode up to this many tokens in this call, each step's choice fed to the next on the
    # device and all of them sent back in one transfer (multi-step decoding); the verifier decodes one where it cannot
    # (core.decode_steps `continues`).
    steps: int = 1
    # The tokens that end the row (its EOS unless ignored, its stop_token_ids): on a CPU, where reading a choice waits
    # for nothing, a block ends at one rather than decode on past it.
    stop_ids: frozenset[int] = frozenset()


@dataclass(slots=True, frozen=True)
class VerifyResult:
    """One sequence's outcome of a verify call: `accepted` drafts then `next_token`, the target's own; or, when its
    prefill was capped by prefill_limit, `prefilling` (the prefill goes on next call) and no tokens at all."""

    accepted: int
    next_token: int | None  # None exactly when prefilling
    # When the request asked (SamplingParams.logprobs): one per emitted token, the accepted drafts then next_token.
    logprobs: list[TokenLogprob] | None = None
    prefilling: bool = False
    # When the request had score_prompt: one per prompt token after the first, in order.
    prompt_logprobs: list[TokenLogprob] | None = None
    # The sequence was new to the verifier: how many of its tokens it found cached (its session's or a prefix another
    # sequence shares), computed by no forward of this request.
    cached_prompt: int = 0
    # A plain row asked for several steps (VerifyRequest.steps): the tokens decoded after next_token, in order.
    more: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.prefilling != (self.next_token is None):
            raise ValueError(f"a verify result has a next token unless it is prefilling, got {self!r}")
        if self.prefilling and self.accepted:
            raise ValueError(f"a prefilling row accepts no drafts, got {self!r}")
        if self.more and (self.accepted or self.prefilling):
            raise ValueError(f"only a plain row decodes more than one token, got {self!r}")

    @classmethod
    def prefill_goes_on(cls) -> VerifyResult:
        """A row whose prompt is still being cached: nothing scored this call."""
        return cls(accepted=0, next_token=None, prefilling=True)


@dataclass(slots=True, frozen=True)
class WorkerHealth:
    """One worker of a side (a draft worker, a target replica, or the one in-process model) as the gateway sees it."""

    name: str
    healthy: bool


TraceCarriers = dict[str, dict[str, str]]  # sequence id -> W3C trace context of its request (traced rows only)


class PoolSide(Protocol):
    """What a gateway asks of either side besides rounds: its workers, where a session's cache lives (by worker
    name, so the answer survives a change in the set of workers), and the trace context of traced rows. In-process
    models answer with one worker and no affinity."""

    def kv_usage(self) -> KVUsage: ...

    def worker_health(self) -> list[WorkerHealth]: ...

    def tensor_parallel(self) -> int: ...

    def session_worker(self, session_id: str) -> str | None: ...

    def pin_session(self, session_id: str, worker: str) -> None: ...

    def waiting_for_worker(self) -> bool:
        """Whether a call is waiting for a worker to come back (every one failed; Ray restarts them): the gateway
        takes no new requests meanwhile."""
        ...

    def others_running(self, seq_id: str) -> int:
        """Sequences other callers (gateways, lanes) run on the worker that holds `seq_id`, as it last said; for one
        not placed yet, the fewest on any worker it may go to. A long prompt's prefill holds their next steps too."""
        ...

    def carry_trace(self, carriers: TraceCarriers | None) -> None: ...

    def reachable(self, timeout_s: float) -> int:
        """How many workers answer within `timeout_s` (a remote call: keep it off an event loop); those that do are
        back in service."""
        ...


class Drafter(PoolSide, Protocol):
    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]: ...

    def release(self, seq_id: str, retain: bool = False) -> None: ...


class Verifier(PoolSide, Protocol):
    vocab_size: int
    context_window: int | None  # most tokens a sequence may hold: the target's positions or KV budget (None: unknown)
    row_layout: RowLayout  # how the target's runner lays out a forward's rows (padded or packed)

    def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]: ...

    def release(self, seq_id: str, retain: bool = False) -> None: ...


class InProcessSide:
    """PoolSide for a model in this process: one worker, always healthy, no affinity, nothing to carry."""

    def worker_health(self) -> list[WorkerHealth]:
        return [WorkerHealth("local", True)]

    def tensor_parallel(self) -> int:
        return 1

    def session_worker(self, session_id: str) -> str | None:
        return None

    def pin_session(self, session_id: str, worker: str) -> None:
        return None

    def others_running(self, seq_id: str) -> int:
        return 0

    def waiting_for_worker(self) -> bool:
        return False

    def carry_trace(self, carriers: TraceCarriers | None) -> None:
        return None

    def reachable(self, timeout_s: float) -> int:
        return 1
