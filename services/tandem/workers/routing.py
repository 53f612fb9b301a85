"""Session-to-worker routing shared by the draft pool and the target replicas.

A running sequence sticks to the worker that holds its KV cache. A worker's load is the sequences it holds for every
caller: this gateway's own, counted here, and, where other callers share the workers (`share`), theirs as its last
reply or answer to a probe said (`observe`; fanout asks workers not heard from for LOAD_FRESH_S before placing new
sequences), so gateways that share a pool spread their sequences over its workers instead of each filling the first.
A new sequence goes to a worker whose KV budget, as it last said, holds it beside the sequences running there (every
caller's, and those this gateway placed since), where one does (`WorkerLoad.fits`): a long prompt is not sent to the
least loaded worker when that one's cache cannot take it while another's can (it would be refused, or free a
sequence of a lower priority there, for nothing).
A new sequence of a known session goes back to the worker that retained the session's cache (its previous turn),
unless that worker is busier than the least loaded one by more than `max_imbalance` sequences. A session's other new
sequences go to the healthy worker ranked first for the session by rendezvous hashing over the workers' names, so
every gateway sharing a pool sends a session to the same worker without talking to the others, and a change in the
set of workers moves only the sessions of the workers that came or went; a worker more than `max_imbalance` busier
than the least loaded one spills the session to the next in rank. A new sequence without a session whose prompt is
longer than PREFIX_ROUTE_TOKENS is placed the same way under a key made of its scope and its prompt's first
PREFIX_ROUTE_TOKENS tokens (`routing_key`), so requests sharing a system prompt meet on the worker whose prefix
cache holds it (core.slots); shorter ones go to the healthy worker whose KV budget they would fill the least (a
slot per sequence as long as the longest: a long prompt beside long sequences, a short one beside short ones; a
worker that has not said its budget counts as empty), then to the least loaded, ties broken in an order of the
gateway's own (`share`), so requests arriving at two gateways in the same instant do not both pick the first. A
worker that fails is benched for a cool-down and its sequences and sessions are routed afresh. A worker whose KV
cache other callers' sequences fill (a call's new rows did not fit: KVCacheFull.ahead) gives those rows up and takes
no new sequence for FULL_AVOID_S while another healthy worker may have room.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter, OrderedDict

from tandem.core.protocol import WorkerLoad

log = logging.getLogger(__name__)

MAX_SESSIONS = 100_000
# A new sequence without a session whose prompt is longer than this many tokens is routed by them: a shared system
# prompt or tool list is usually longer; a prompt whose first tokens are a chat template's alone is shorter.
PREFIX_ROUTE_TOKENS = 128
FULL_AVOID_S = 1.0  # how long new sequences avoid a worker that other callers' sequences filled
LOAD_FRESH_S = 0.5  # a worker's word on its load older than this is asked again before new sequences are placed


class AffinityRouter:
    def __init__(self, size: int, cooldown_s: float, role: str, max_imbalance: int = 2,
                 names: list[str] | None = None) -> None:
        if size < 1:
            raise ValueError(f"a {role} pool needs at least one worker")
        self.size, self.cooldown_s, self.role = size, cooldown_s, role
        self.names = list(names) if names else [f"{role}-{i}" for i in range(size)]
        self.max_imbalance = max_imbalance
        self.affinity: dict[str, int] = {}  # running sequence -> worker
        self.session_of: dict[str, str] = {}  # running sequence -> its session
        self.sessions: OrderedDict[str, int] = OrderedDict()  # session -> worker that retained its last sequence
        self.benched_until = [0.0] * size
        # Benched workers (by name) that must answer a probe once their cool-down is over before they are given rows
        # again (a draft pool's: RayDrafter); until then no round routes to them, whenever the cool-down ends.
        self.probe_first: set[str] = set()
        self.full_until = [0.0] * size  # new sequences go elsewhere until then (mark_full)
        self.others = [0] * size  # sequences other callers hold on each worker, as it last said (observe)
        self.loads: list[WorkerLoad | None] = [None] * size  # each worker's last word on what it holds (observe)
        self.heard_at = [float("-inf")] * size  # when each worker last said (or was last asked)
        self.session_hits = 0
        self.shared_as = ""  # this caller's key where others call the same workers (share)
        self._tie_rank = list(range(size))  # among equally loaded workers the lowest goes first

    def share(self, key: str) -> None:
        """Other callers (gateways, lanes, canary arms) use these workers too, and `key` is this one's own (its
        wire-id prefix): workers are asked for their load (`unheard`), and equally loaded ones are taken in rendezvous
        rank for `key`, so callers differ. "" (a private pool's one caller): neither."""
        self.shared_as = key
        self._tie_rank = (list(range(self.size)) if not key else
                          [-rendezvous_score(key, name) for name in self.names])

    def healthy(self, index: int) -> bool:
        """Its cool-down is over (if it was benched)."""
        return time.monotonic() >= self.benched_until[index]

    def routable(self, index: int) -> bool:
        """Healthy, and not waiting to answer a probe (probe_first)."""
        return self.healthy(index) and self.names[index] not in self.probe_first

    def route(self, seq_id: str, session: str = "", tokens: int = 0) -> int | None:
        """The worker of a sequence (None: no routable one); a new one's `tokens`: how long it is (0: not judged)."""
        index = self.affinity.get(seq_id)
        if index is not None and self.routable(index):
            return index
        candidates = [i for i in range(self.size) if self.routable(i)]
        if not candidates:
            return None
        now = time.monotonic()
        candidates = [i for i in candidates if now >= self.full_until[i]] or candidates
        load = Counter(self.affinity.values())
        for i in candidates:
            load[i] += self.others[i]
        candidates = [i for i in candidates if self._fits(i, load[i] + 1, tokens)] or candidates
        if session:
            least = min(load[i] for i in candidates)
            ranked = sorted(candidates, key=lambda i: rendezvous_score(session, self.names[i]), reverse=True)
            choice = next(i for i in ranked if load[i] <= least + self.max_imbalance)
        else:
            choice = min(candidates, key=lambda i: (self._fill(i, load[i] + 1, tokens), load[i], self._tie_rank[i]))
        preferred = self.sessions.get(session) if session and index is None else None
        if (preferred is not None and preferred in candidates
                and load[preferred] <= load[choice] + self.max_imbalance):
            choice = preferred
            self.session_hits += 1
        self.affinity[seq_id] = choice
        if session:
            self.session_of[seq_id] = session
        return choice

    def _fits(self, index: int, sequences: int, tokens: int) -> bool:
        """Whether worker `index` has room for `sequences` running sequences, one `tokens` long, as it last said
        (a worker not heard from yet, or a sequence of unknown length: yes; the worker itself has the last word)."""
        said = self.loads[index]
        return said is None or not tokens or said.fits(sequences, tokens)

    def _fill(self, index: int, sequences: int, tokens: int) -> float:
        """The share of worker `index`'s KV budget that `sequences` running sequences, one `tokens` long, would take,
        as it last said (0: not known): a long prompt goes where the slots are long already, a short one where they
        are short, and KV is left for the sequences to grow."""
        said = self.loads[index]
        return said.fill(sequences, tokens) if said is not None else 0.0

    def group(self, keys: list[tuple[str, str, int]]) -> dict[int | None, list[int]]:
        """Row numbers per worker index (None: no healthy worker), for (sequence, session, tokens) triples."""
        groups: dict[int | None, list[int]] = {}
        for row, (seq_id, session, tokens) in enumerate(keys):
            groups.setdefault(self.route(seq_id, session, tokens), []).append(row)
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

    def mark_full(self, index: int, seq_ids: list[str]) -> None:
        """Other callers' sequences fill `index`'s cache: these new sequences leave it (routed afresh at their next
        call), and new sequences go to other healthy workers for FULL_AVOID_S (to it still where none is left)."""
        self.full_until[index] = time.monotonic() + FULL_AVOID_S
        for seq_id in seq_ids:
            if self.affinity.get(seq_id) == index:
                del self.affinity[seq_id]
                self.session_of.pop(seq_id, None)

    def observe(self, index: int, load: WorkerLoad) -> None:
        """Worker `index` holds what `load` says, for every caller: its sequences beyond this gateway's own are
        others'."""
        own = sum(1 for i in self.affinity.values() if i == index)
        self.others[index] = max(0, load.sequences - own)
        self.loads[index] = load
        self.heard_at[index] = time.monotonic()

    def others_beside(self, seq_id: str) -> int:
        """Other callers' sequences on the worker of `seq_id`, as it last said; for one not placed yet, the fewest on
        a worker new sequences may go to (0 where none may)."""
        index = self.affinity.get(seq_id)
        if index is not None:
            return self.others[index]
        return min((self.others[i] for i in range(self.size) if self.routable(i)), default=0)

    def unheard(self) -> list[int]:
        """Healthy workers not heard from (nor asked) for LOAD_FRESH_S: their load is worth asking before new
        sequences are placed. Marks them asked, so one that does not answer is not asked again at once."""
        if self.size == 1 or not self.shared_as:
            return []
        now = time.monotonic()
        stale = [i for i in range(self.size) if now - self.heard_at[i] > LOAD_FRESH_S and self.healthy(i)]
        for i in stale:
            self.heard_at[i] = now
        return stale

    def forget(self, seq_id: str, retained: bool = False) -> int | None:
        """A sequence ended; with `retained`, its worker keeps the cache for the session's next sequence."""
        index = self.affinity.pop(seq_id, None)
        session = self.session_of.pop(seq_id, "")
        if retained and session and index is not None:
            self.pin(session, index)
        return index

    def resize(self, names: list[str]) -> None:
        """The pool's workers are now `names`: sequences and sessions keep their worker where it stayed (at its new
        index); those of workers that left are routed afresh (the new worker reports them lost: history resent)."""
        where = {name: i for i, name in enumerate(names)}
        moved = {old: where.get(name) for old, name in enumerate(self.names)}
        self.affinity = {s: moved[i] for s, i in self.affinity.items() if moved.get(i) is not None}
        self.session_of = {s: v for s, v in self.session_of.items() if s in self.affinity}
        self.sessions = OrderedDict((s, moved[i]) for s, i in self.sessions.items() if moved.get(i) is not None)
        benched = dict(zip(self.names, self.benched_until, strict=True))
        others = dict(zip(self.names, self.others, strict=True))
        loads = dict(zip(self.names, self.loads, strict=True))
        self.names, self.size = list(names), len(names)
        self.benched_until = [benched.get(name, 0.0) for name in names]
        self.probe_first &= set(names)
        self.full_until = [0.0] * self.size
        self.others = [others.get(name, 0) for name in names]
        self.loads = [loads.get(name) for name in names]
        self.heard_at = [float("-inf")] * self.size
        self.share(self.shared_as)

    def pin(self, session: str, index: int) -> None:
        """Route the session's next sequence to `index` (its cache, or state loaded from the session store)."""
        if not 0 <= index < self.size:
            return
        self.sessions.pop(session, None)
        self.sessions[session] = index
        while len(self.sessions) > MAX_SESSIONS:
            self.sessions.popitem(last=False)


def routing_key(request) -> str:
    """What places a call's row (a DraftRequest or VerifyRequest): its session; for a new sequence without one, its
    scope and its prompt's first PREFIX_ROUTE_TOKENS tokens when it has more; else nothing (the least loaded)."""
    if request.session:
        return request.session
    if request.keep or len(request.append) <= PREFIX_ROUTE_TOKENS:
        return ""
    head = b"".join(token.to_bytes(4, "little") for token in request.append[:PREFIX_ROUTE_TOKENS])
    return f"\0prefix\0{request.cache_scope}\0{hashlib.blake2b(head, digest_size=8).hexdigest()}"


def routing_tokens(request) -> int:
    """How long a call's row makes its sequence (a DraftRequest or VerifyRequest): what a new one needs of a KV
    budget (`AffinityRouter.route`)."""
    drafted = request.k if hasattr(request, "k") else len(request.draft.tokens) if request.draft else 0
    return request.keep + len(request.append) + 1 + drafted


def rendezvous_score(key: str, worker: str) -> int:
    """Highest-random-weight hashing: every gateway ranks workers for a key alike, with no shared state."""
    return int.from_bytes(hashlib.blake2b(f"{key}\0{worker}".encode(), digest_size=8).digest(), "big")
