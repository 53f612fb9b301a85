"""How a stored response keeps its conversation: the items it added to its predecessor's, not a copy of them.

A response that continues another (previous_response_id) answered that one's conversation and output, less its
oldest items where `truncation: auto` dropped some, then its own input. Stored whole in every record, a chain of n
turns held its first turn n times: O(n²) bytes per chain, each turn's record as large as the whole conversation.

So a stored response is two records. Its head (what GET returns, its TTL its own) names its segment and its chain:
the segments of the responses before it, oldest first. Its segment (`Segment`) holds what it added: how many items of
its predecessor's conversation it left out from the front (`skip`), its own input, its output. A conversation is
rebuilt from the chain's segments oldest first (`conversation_of`), read in one round trip; each segment is parsed
once, and only the head's own chain (a short id per turn) is read. A segment lives as long as its head, or a later
response's, was last stored; a segment id is drawn at random per response, so an id a deleted response frees never
names what a later response still reads.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

CHAIN_SEPARATOR = " "  # (segment ids are hex)


@dataclass(slots=True, frozen=True)
class Segment:
    skip: int  # items of the predecessor's conversation left out, from its front
    items: list[dict]  # the response's own input (its whole conversation where it links to no predecessor)
    output: list[dict]

    @classmethod
    def of(cls, record: object) -> Segment | None:
        if not isinstance(record, dict) or not {"skip", "items", "output"} <= record.keys():
            return None
        return cls(record["skip"], record["items"], record["output"])

    def fields(self) -> dict:
        return {"skip": self.skip, "items": self.items, "output": self.output}

    def answered(self, before: list[dict]) -> list[dict]:
        """The conversation the response answered, given its predecessor's (`before`)."""
        return before[self.skip:] + self.items


def conversation_of(segments: list[Segment]) -> list[dict]:
    """The conversation a response continuing the last of a chain's `segments` (oldest first) starts from."""
    conversation: list[dict] = []
    for segment in segments:
        conversation = segment.answered(conversation) + segment.output
    return conversation


def split(before: list[dict], items: list[dict]) -> tuple[int, list[dict]]:
    """(skip, own) with items == before[skip:] + own: `items`, what a response continuing a conversation `before`
    answered, is a suffix of it (truncation keeps the newest) and then the response's input. Items are compared
    whole, so a history that is no such suffix is kept in `own` instead (exact, only larger)."""
    first = items[0].get("id") if items else None
    start = next((index for index, item in enumerate(before) if first is not None and item.get("id") == first),
                 len(before))
    kept = len(before) - start
    if items[:kept] != before[start:]:
        start, kept = len(before), 0
    return start, items[kept:]


def new_segment_id() -> str:
    return secrets.token_hex(8)


def chain_text(segment_ids: list[str]) -> str:
    return CHAIN_SEPARATOR.join(segment_ids)


def chain_ids(text: str) -> list[str]:
    return text.split(CHAIN_SEPARATOR) if text else []
