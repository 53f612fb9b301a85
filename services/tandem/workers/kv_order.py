"""Which sequence a full worker frees: one KV budget shared by every caller of a pool worker.

A pool worker holds the caches of every gateway's (and engine lane's) sequences, and an engine whose call does not
fit can free only its own (core.engine). So the worker orders every sequence it holds by (priority, arrival, id):
lower priority values first, then earlier arrivals (core.protocol.RowOrder), the id breaking ties. A call that does
not fit frees the caches of held sequences that come after every row of the call, the last first, until it fits.
Their gateways find them lost at their next call and resend their history: their tokens do not change (greedy and
seeded choices depend on the context alone). A call's rows never free a sequence that comes before any of them, so a
background row cannot push out an interactive one, nor a newcomer an older request of equal priority.

The order is total and every worker keeps the same one, so the first sequence can always run and none waits on
another forever. What is left in the way when nothing more may be freed comes before some row of the call; the
worker says so (KVCacheFull.ahead), and an engine with nothing of its own to give up waits for those to finish
rather than failing a request that would fit alone.

The ranks of a tensor-parallel replica run the same calls in the same order, so they free the same sequences.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from tandem.core.protocol import RowOrder

Rank = tuple[RowOrder, str]


class HeldOrder:
    """The order of the sequences a worker holds, learnt from the calls that sent them."""

    def __init__(self) -> None:
        self._ranks: dict[str, Rank] = {}

    def note(self, requests: Sequence, held: Collection[str]) -> None:
        """Record each request's place; forgets sequences no longer held once those outnumber the held ones (the
        sizes are compared first: most calls build no set)."""
        for request in requests:
            self._ranks[request.seq_id] = (request.order, request.seq_id)
        if len(self._ranks) > 2 * (len(held) + len(requests)) + 64:
            keep = set(held) | {request.seq_id for request in requests}
            self._ranks = {seq_id: rank for seq_id, rank in self._ranks.items() if seq_id in keep}

    def forget(self, seq_id: str) -> None:
        self._ranks.pop(seq_id, None)

    def victim(self, requests: Sequence, held: Iterable[str]) -> str | None:
        """The held sequence to free for this call: the last of those after every row of the call; None if none is."""
        in_call = {request.seq_id for request in requests}
        last = max(self._ranks[seq_id] for seq_id in in_call)
        later = [rank for seq_id in held if seq_id not in in_call and (rank := self._ranks.get(seq_id)) is not None
                 and rank > last]
        return max(later)[1] if later else None

    @staticmethod
    def others_held(requests: Sequence, held: Iterable[str]) -> bool:
        """Whether sequences of other calls hold part of the cache (after victim() found none to free: ahead)."""
        in_call = {request.seq_id for request in requests}
        return any(seq_id not in in_call for seq_id in held)
