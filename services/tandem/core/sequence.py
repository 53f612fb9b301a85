"""What a runner knows of one sequence: its tokens, how many of them have keys and values cached, and where.

Rolling back is O(1): truncating `cached` only moves a length; the next forward overwrites the stale keys and values
in place (core.kv_cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SequenceState:
    """Tokens a runner knows for one sequence; the first `cached` of them have keys and values in slot `slot`."""

    tokens: list[int] = field(default_factory=list)
    cached: int = 0
    session: str = ""
    slot: int = -1
    scope: str = ""  # whose sequences may share this one's cached prefix (a tenant): only those of the same scope
    shareable: bool = False  # a request's sequence (not a warm-up's): once finished, its prefix may serve others

    def sync(self, keep: int, append: list[int]) -> None:
        """Truncate to the first `keep` tokens, then append new ones; cached tokens past `keep` that `append`
        repeats stay cached, the rest are rolled back."""
        if keep > len(self.tokens):
            raise ValueError(f"cannot keep {keep} tokens of a sequence that has {len(self.tokens)}")
        stale = self.tokens[keep : self.cached]
        del self.tokens[keep:]
        self.tokens.extend(append)
        if self.cached > keep:
            same = next((i for i, (a, b) in enumerate(zip(stale, append, strict=False)) if a != b),
                        min(len(stale), len(append)))
            if keep + same < self.cached:
                self.truncate_cache(keep + same)

    def truncate_cache(self, length: int) -> None:
        """Forget cached keys and values past `length`: the next forward overwrites them in place."""
        self.cached = min(self.cached, length)

    @property
    def pending(self) -> list[int]:
        return self.tokens[self.cached :]
