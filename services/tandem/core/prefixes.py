"""Prefix caching's choices, for core.slots: which held sequence a new one copies its prompt's prefix from, and which
finished ones kept for their prefix another makes redundant.

A new sequence whose prompt starts like a sequence the runner holds (running, a session's retained one, or a finished
one kept for its prefix) copies that prefix's keys and values into its own slot instead of computing them, when they
are at least MIN_SHARED_PREFIX tokens: a system prompt, tool definitions or few-shot examples shared by many requests
are computed once. A copy is one memory pass over the prefix's cache (about 28 KiB a token for the 1.5B target in
bf16); computing it reads every weight. Only sequences of the same `scope` (a tenant) share, so no tenant can time
its way to another's prompts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from tandem.core.sequence import SequenceState

# Shorter common prefixes are computed: a copy this short saves little, and a chat template's first tokens are common
# to every request.
MIN_SHARED_PREFIX = 16
PREFIX = "prefix"  # a runner's retained key (PREFIX, seq_id): a finished sequence kept for its prefix, not a session's

Key = str | tuple[str, str] | None


def common_prefix(held: SequenceState, tokens: list[int], reach: int | None = None) -> int:
    """How many of `held`'s cached tokens (its first `reach` tokens, cached or not, where given) `tokens` begins
    with."""
    limit = min(held.cached if reach is None else reach, len(held.tokens), len(tokens))
    if not limit or held.tokens[0] != tokens[0]:  # most held sequences, told apart at the cost of one token
        return 0
    if held.tokens[:limit] == tokens[:limit]:
        return limit
    return next(i for i, (a, b) in enumerate(zip(held.tokens[:limit], tokens[:limit], strict=True)) if a != b)


def best_source(held: Iterable[tuple[Key, SequenceState]], state: SequenceState, prompt: list[int]
                ) -> tuple[Key, SequenceState | None, int]:
    """The held sequence (with its key) whose cache covers the longest prefix of `prompt` among those of `state`'s
    scope, and how many tokens to copy: at most all but the prompt's last token, which is fed to score the first
    round; (None, None, 0) when no prefix reaches MIN_SHARED_PREFIX."""
    best, best_key, length = None, None, 0
    for key, other in held:
        usable = other is not state and other.scope == state.scope and other.cached > length
        if usable and (common := common_prefix(other, prompt)) > length:
            best, best_key, length = other, key, common
    length = min(length, len(prompt) - 1)
    return (best_key, best, length) if best is not None and length >= MIN_SHARED_PREFIX else (None, None, 0)


def redundant(retained: Mapping[Key, SequenceState], state: SequenceState) -> list[Key]:
    """The keys of finished sequences kept for their prefix whose whole cache `state` holds too."""
    cached = state.tokens[: state.cached]
    return [key for key, held in retained.items()
            if isinstance(key, tuple) and held.scope == state.scope and common_prefix(held, cached) == held.cached]
