"""Incremental detokenization: emit text deltas that never split a UTF-8 character or leak a stop string."""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...] = ()) -> None:
        self.decode = decode
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.tokens: list[int] = []
        self.emitted = 0

    def push(self, token_ids: list[int], final: bool = False, cut: int | None = None) -> str:
        """Add tokens; return the newly safe text. On the final push, `cut` truncates at a stop string."""
        self.tokens.extend(token_ids)
        text = self.decode(self.tokens)
        if cut is not None:
            text = text[:cut]
        if not final:
            # A trailing replacement character is an incomplete multi-byte sequence still waiting for tokens.
            text = text.rstrip(REPLACEMENT)
            text = text[: max(self.emitted, len(text) - self.holdback)]
        delta = text[self.emitted :]
        self.emitted = max(self.emitted, len(text))
        return delta
