"""Which sequence holds which slot of a runner's KV cache, what finished sequences it keeps, and its KV budget.

The sequences being run (`states`) hold the slots [0, active). Releasing a sequence moves the highest active one into
its slot: one copy of that sequence's keys and values, once, never per step.

A finished sequence of a session may be retained (bounded by the tokens its slot reserves, least recently used first
out) so the session's next request reuses the cache of their common prefix: a chat's next turn starts with the whole
previous conversation. It keeps its keys and values in a slot at or above `active`, and is moved back below when its
session returns.

With prefix caching (`prefix_cache`, core.prefixes) a finished sequence of no session is retained the same way, for
its prefix, and a new sequence starts from a copy of the longest prefix of its prompt held here.

Memory is bounded by a KV token budget counted as slots x capacity (each slot reserves the longest sequence's
length). A sequence or a forward that would not fit evicts retained sessions, least recently used first, and then
raises KVCacheFull before anything of that call is written. Capacity grows geometrically with the longest sequence
held, and shrinks again once the sequences that needed it are gone (SHRINK_ABOVE).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from tandem.core.kv_cache import SlotCache
from tandem.core.prefixes import MIN_SHARED_PREFIX, PREFIX, Key, best_source, common_prefix, redundant
from tandem.core.protocol import KVCacheFull
from tandem.core.sequence import SequenceState

MIN_SLOTS = 1
MIN_CAPACITY = 256
CAPACITY_ALIGN = 64
# A forward finding the cache over this many times the length it holds shrinks it to twice that length: inside a CUDA
# graph attention reads every position of the buffers, so a capacity left by one long sequence that has gone costs
# every later step (on an H200 one attention call took 15.5 us over 256 positions, 88.5 us over 4096).
SHRINK_ABOVE = 4


class SlotTable:
    """The slots of one KV cache and the sequences in them; the runner over it (core.runner) computes `prefill`."""

    def __init__(self, cache: SlotCache, kv_tokens_capacity: int, retain_tokens: int, prefix_cache: bool) -> None:
        self.cache = cache
        self.kv_tokens_capacity = kv_tokens_capacity
        self.occupants: list[SequenceState | None] = []  # by slot
        self.states: dict[str, SequenceState] = {}  # the active sequences, in slots [0, len(states))
        self.retain_tokens = retain_tokens
        self.prefix_cache = prefix_cache
        # session -> its last finished sequence; (PREFIX, seq_id) -> a finished sequence kept for its prefix
        self.retained: OrderedDict[Key, SequenceState] = OrderedDict()
        # Held while a session's state moves between `states` and `retained`, and while kv_tokens_used reads them
        # from another thread (metrics, info()): a state on the move would be counted in neither, or in both.
        self._moving = threading.Lock()
        self.reused_tokens = 0  # cached tokens new sequences started with (a session's or a shared prefix)
        self.shared_tokens = 0  # of those, the ones copied from another sequence's prefix

    def prefill(self, state: SequenceState, upto: int) -> None:
        """Cache the first `upto` tokens of `state` (the runner's forward)."""
        raise NotImplementedError

    def state(self, seq_id: str, session: str = "", prompt: list[int] | None = None, scope: str = ""
              ) -> SequenceState:
        """The state of `seq_id`; a new one starts from its session's retained cache when there is one, and (given
        its `prompt`, with prefix caching on) from a copy of the longest cached prefix of that prompt held here by a
        sequence of the same `scope` where that covers more of the prompt than the session's own cache does."""
        if seq_id not in self.states:
            if session and session in self.retained:
                with self._moving:
                    state = self.retained.pop(session)
                    self.states[seq_id] = state
            else:
                self._fit(extra_slots=1, length=0)
                state = SequenceState(session=session, slot=self.occupants.index(None), scope=scope,
                                      shareable=prompt is not None)
                self.occupants[state.slot] = state
                self.states[seq_id] = state
            self._exchange(state.slot, len(self.states) - 1)  # the next active slot
            if prompt is not None and self.prefix_cache:
                self._share_prefix(state, prompt)
        return self.states[seq_id]

    def release(self, seq_id: str, retain: bool = False) -> None:
        """Drop a sequence; with `retain`, keep its cache for its session's next request. With prefix caching a
        request's sequence is kept for its prefix otherwise (unless another kept one holds all of it)."""
        state = self.states.get(seq_id)
        if state is None:
            return
        key: Key = None
        if retain and state.session and state.cached:
            key = state.session
        elif self.prefix_cache and state.shareable and state.cached >= MIN_SHARED_PREFIX:
            key = (PREFIX, seq_id)
        self._exchange(state.slot, len(self.states) - 1, keep_a=key is not None)  # the highest active fills the hole
        if key is None:
            del self.states[seq_id]
            self._free(state)
            return
        if (replaced := self.retained.pop(key, None)) is not None:
            self._free(replaced)
        for other in redundant(self.retained, state):  # kept prefixes this one holds whole
            self._free(self.retained.pop(other))
        with self._moving:
            del self.states[seq_id]
            self.retained[key] = state
        # Counted as the memory they hold: a slot as long as the cache's (a 3-token session holds as much as a long
        # one), so --retain-tokens bounds what finished sequences keep of the KV budget; counted by their own tokens,
        # thousands of short sessions reserved the whole budget (70x what they held).
        while self.retained and len(self.retained) * self.cache.capacity > self.retain_tokens:
            self._free(self.retained.popitem(last=False)[1])

    def share_among(self, fresh: list[SequenceState]) -> list[int]:
        """Sequences new in one call (in this order) whose tokens share a prefix nothing held had: the first of them
        computes it, in a forward of its own, and the later ones copy it, where it is at least MIN_SHARED_PREFIX
        tokens longer than what they found cached (a burst of requests with one system prompt, a request's n
        choices). Returns the positions in `fresh` of those that copied."""
        copied: list[int] = []
        if not self.prefix_cache:
            return copied
        for index, state in enumerate(fresh):
            leader, length = None, 0
            for other in fresh[:index]:
                if other.scope == state.scope:
                    reach = min(len(state.tokens), len(other.tokens)) - 1
                    if (common := common_prefix(other, state.tokens, reach)) > length:
                        leader, length = other, common
            if leader is None or length < state.cached + MIN_SHARED_PREFIX:
                continue
            if leader.cached < length:
                self.prefill(leader, length)
            self._copy_prefix(leader, state, length)
            copied.append(index)
        return copied

    @property
    def retained_sessions(self) -> int:
        return sum(isinstance(key, str) for key in self.retained)

    @property
    def retained_prefixes(self) -> int:
        return len(self.retained) - self.retained_sessions

    def _share_prefix(self, state: SequenceState, prompt: list[int]) -> None:
        """Start `state` from a copy of the longest cached prefix of `prompt` held by a sequence of its scope, where
        that is longer than what its own cache (a session's) holds of the prompt."""
        best_key, best, length = best_source([*self.retained.items(), *((None, s) for s in self.states.values())],
                                             state, prompt)
        own = common_prefix(state, prompt)
        if best is None or length <= own:
            return
        state.truncate_cache(own)  # what of its own cache the prompt repeats: the copy adds the rest
        state.tokens[:] = prompt[:length]
        self._copy_prefix(best, state, length)
        if best_key is not None:
            self.retained.move_to_end(best_key)  # used: the last to be evicted

    def _copy_prefix(self, source: SequenceState, state: SequenceState, length: int) -> None:
        """`state`'s first `length` tokens, the same as `source`'s, take `source`'s keys and values."""
        self.cache.copy(source.slot, state.slot, length)
        self.shared_tokens += length - state.cached
        state.cached = length

    @property
    def kv_tokens_used(self) -> int:
        """Tokens whose keys and values are held: the active sequences' and the retained sessions'. Safe to read
        from another thread (metrics, info()) while the runner works: both dicts are copied under the lock a
        session's move between them holds."""
        with self._moving:
            held = [*self.states.values(), *self.retained.values()]
        return sum(state.cached for state in held)

    def running_load(self) -> tuple[int, int]:
        """The active sequences and the cached tokens of the longest; safe from another thread, as kv_tokens_used."""
        with self._moving:
            running = [*self.states.values()]
        return len(running), max((state.cached for state in running), default=0)

    @property
    def kv_tokens_reserved(self) -> int:
        """Tokens the cache has room for (slots x capacity), allocated or about to be; within kv_tokens_capacity."""
        return self.cache.slots * self.cache.capacity

    def _fit(self, extra_slots: int, length: int, shrink: bool = False) -> None:
        """Make the cache hold `extra_slots` more sequences and one of `length` tokens, evicting retained sessions
        if the budget asks; KVCacheFull if even that is not enough. With `shrink` (a forward, whose `length` is the
        furthest it reaches, so a new long prompt is counted before anything shrinks), an oversized cache shrinks."""
        budget = self.kv_tokens_capacity
        while True:
            slots = len(self.states) + len(self.retained) + extra_slots
            longest = max([length, 1] + [s.cached for s in self.occupants if s is not None])
            if slots * longest <= budget:
                break
            if not self.retained:
                raise KVCacheFull(slots * longest, budget)
            self._free(self.retained.popitem(last=False)[1])
        held, capacity = self.cache.slots, self.cache.capacity
        oversized = shrink and capacity > SHRINK_ABOVE * max(longest, MIN_CAPACITY)
        if slots <= held and longest <= capacity and not oversized:
            return
        # Grow geometrically (few reallocations), but never past the budget.
        new_capacity = capacity
        if longest > capacity:
            new_capacity = _aligned(max(longest, 2 * capacity, MIN_CAPACITY))
        elif oversized:
            new_capacity = _aligned(max(2 * longest, MIN_CAPACITY))
        new_capacity = max(longest, min(new_capacity, budget // slots))
        new_slots = held if slots <= held else max(slots, 2 * held, MIN_SLOTS)
        new_slots = max(slots, min(new_slots, budget // new_capacity))
        for slot in range(new_slots, held):  # fewer, longer slots: bring every sequence below the new count
            if self.occupants[slot] is not None:
                self._exchange(slot, self.occupants.index(None))
        self.cache.reshape(new_slots, new_capacity)
        self.occupants = self.occupants[:new_slots] + [None] * (new_slots - len(self.occupants))

    def _exchange(self, a: int, b: int, keep_a: bool = True) -> None:
        """Swap the sequences (or emptiness) of two slots, copying what each holds; `keep_a` False drops a's."""
        if a == b:
            return
        first, second = self.occupants[a], self.occupants[b]
        self.cache.swap(a, b, first.cached if first and keep_a else 0, second.cached if second else 0)
        self.occupants[a], self.occupants[b] = second, first
        for state, slot in ((first, b), (second, a)):
            if state is not None:
                state.slot = slot

    def _free(self, state: SequenceState) -> None:
        self.occupants[state.slot] = None
        state.slot = -1


def _aligned(tokens: int) -> int:
    return -(-tokens // CAPACITY_ALIGN) * CAPACITY_ALIGN
