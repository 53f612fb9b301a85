"""Incremental detokenization: emit text deltas that never split a UTF-8 character or leak a stop string.

Both the stream (IncrementalDetokenizer) and the stop checker (core.stops) build the output's text with
IncrementalDecoder, which decodes a bounded window of tokens per push instead of the whole output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"

Decode = Callable[[list[int]], str]

# A character's bytes span at most 4 tokens (every token but a skipped special carries a byte), so text waiting on
# more than that has a token boundary ending in a whole character to commit up to, unless the tokens are invalid
# bytes or skipped specials: once MAX_STALL of them wait, all but the last 3 (which may begin a character) commit.
MAX_CHAR_TOKENS = 4
MAX_STALL = 16


def decoder(tokenizer) -> Decode:
    """The text of token ids as the engine and the gateway show it: special tokens left out."""

    def decode(token_ids: list[int]) -> str:
        return tokenizer.decode(token_ids, skip_special_tokens=True)

    return decode


class IncrementalDecoder:
    """The text of a growing token sequence, decoding only a window of the last tokens per push.

    The prefix and read offsets of vLLM and TGI: the window starts at the tokens committed by the previous commit
    (their text, decoded alone, is the reference the window's text is diffed against, so decoders that treat the
    first token specially, such as SentencePiece's leading space, diff out evenly) and runs to the newest token.
    Text is committed only up to a token boundary where it ends in a whole character; the rest stays `pending`.
    """

    def __init__(self, decode: Decode, max_stall: int = MAX_STALL) -> None:
        self.decode = decode
        self.max_stall = max_stall
        self.tokens: list[int] = []  # from the prefix offset on; earlier tokens are never decoded again
        self.read = 0  # index in self.tokens of the first uncommitted token
        self.prefix_text = ""  # self.tokens[: self.read] decoded alone
        self.pending = ""  # the uncommitted tokens' text as decoded now; it may end in an incomplete character
        self.count = 0  # tokens pushed in all
        self.committed = 0  # characters committed in all
        self.window = 0  # tokens the last push decoded

    @property
    def stable_pending(self) -> str:
        """The pending text that can no longer change: all of it but a trailing incomplete character."""
        return self.pending.rstrip(REPLACEMENT)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the newly committed text."""
        if not token_ids:
            return ""
        self.tokens.extend(token_ids)
        self.count += len(token_ids)
        self.window = len(self.tokens)
        text = self._text(len(self.tokens))
        if _whole(text):
            return self._commit(text, len(self.tokens), "")
        waiting = len(self.tokens) - self.read
        if waiting > MAX_CHAR_TOKENS:
            # The incomplete character started in the last few tokens: commit the whole ones before it.
            for end in range(len(self.tokens) - 1, max(self.read, len(self.tokens) - MAX_CHAR_TOKENS), -1):
                head = self._text(end)
                if _whole(head):
                    return self._commit(head, end, text[len(head) :])
            if waiting > self.max_stall:  # no whole character for a while: invalid bytes, commit them as decoded
                end = len(self.tokens) - MAX_CHAR_TOKENS + 1
                head = self._text(end)
                return self._commit(head, end, text[len(head) :])
        # A trailing U+FFFD is a character whose bytes have not all arrived; an empty text is skipped special
        # tokens, kept so that the next visible token decodes with them as context.
        self.pending = text
        return ""

    def flush(self) -> str:
        """Commit whatever is pending as decoded (the output is over: an incomplete character stays U+FFFD)."""
        return self._commit(self.pending, len(self.tokens), "") if self.read < len(self.tokens) else ""

    def _text(self, end: int) -> str:
        return self.decode(self.tokens[:end])[len(self.prefix_text) :]

    def _commit(self, text: str, end: int, pending: str) -> str:
        del self.tokens[: self.read]
        self.read = end - self.read
        self.prefix_text = self.decode(self.tokens[: self.read])
        self.pending = pending
        self.committed += len(text)
        return text


def _whole(text: str) -> bool:
    return bool(text) and not text.endswith(REPLACEMENT)


def stop_prefix_length(text: str, stops: Sequence[str]) -> int:
    """The length of the longest suffix of `text` that a stop string starts with (and could still complete)."""
    longest = max((len(s) for s in stops), default=1) - 1
    for n in range(min(longest, len(text)), 0, -1):
        tail = text[-n:]
        if any(s.startswith(tail) for s in stops):
            return n
    return 0


class IncrementalDetokenizer:
    """Text deltas for a stream of output tokens that the engine has already cut at stops.

    The engine reports a stop string only with the token completing it, so text that could begin one is held
    back until the next push shows it did not; the final push cuts at the engine's `text_cut`.
    """

    def __init__(self, decode: Decode, stop: tuple[str, ...] = ()) -> None:
        self.text = IncrementalDecoder(decode)
        self.stop = tuple(s for s in stop if s)
        self.held = ""  # committed text not yet emitted
        self.emitted = 0

    def push(self, token_ids: list[int], final: bool = False, cut: int | None = None) -> str:
        """Add tokens; return the newly safe text. On the final push, `cut` truncates at a stop string."""
        self.held += self.text.push(token_ids)
        if final:
            self.held += self.text.flush()
            end = len(self.held) if cut is None else max(0, cut - self.emitted)
        else:
            end = len(self.held) - stop_prefix_length(self.held, self.stop)
        delta, self.held = self.held[:end], "" if final else self.held[end:]
        self.emitted += len(delta)
        return delta
