"""Drafts copied from the request's own context (prompt lookup decoding): free drafts where the output repeats text.

An output often repeats what its context holds: code being edited or explained, a document summarised or quoted,
an answer that names the question's terms, a list whose entries share a shape. Where the output's last tokens (an
n-gram of MIN_NGRAM to MAX_NGRAM tokens, the longest first) occur earlier in the prompt or the output, the tokens
that followed them there are proposed as the round's drafts, with no draft model; the target verifies them in one
forward as it verifies a predicted output's (core.prediction), so the output is exactly what it would be without
them: a greedy or seeded row accepts a token equal to the target's choice, an unseeded sampled row accepts it with
probability p(token) (q one-hot) and resamples from p without it otherwise.

Which occurrence: where the output would stand had it followed the last offer, if its last tokens are there (a copy
going on); else the latest one (text repeated inside the output, the prompt's own otherwise). A unigram matches
almost anywhere and rarely continues: MIN_NGRAM 2. Whether a round drafts from the lookup or from the draft model is
the round plan's (core.round_plan rule 0): the one that makes more tokens per second at the acceptance each has had.

What a looked-up draft's acceptance is depends less on the request than on how long the match behind it is: a
two-token match in freshly written text is a guess (on the real pair, a code fence's closing backticks offered what
followed them in the prompt: the turn's end), while a copy going on matches as far back as it has copied. So the
engine keeps one acceptance estimate per match length class (`LookupAcceptance`), learnt from every request's
looked-up rounds and fading with time, and a round is priced at its offer's class.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tandem.core.policy import SharedPrior

MIN_NGRAM = 2  # the shortest run of the output's last tokens looked up
MAX_NGRAM = 4  # the longest
PRIOR_ACCEPTANCE = 0.6  # a match length class's per-token acceptance before the engine has measured it
PRIOR_WEIGHT = 4.0  # in drafted tokens
MATCH_CLASSES = (2, 3, 4, 8, 16)  # the shortest match of each class; a match is measured back up to the last
PACE_DECAY = 0.75  # a round's weight in its row's pace, a round later: the pace is about the last four rounds


class PromptLookup:
    """The n-gram search over one request's context (prompt then output), with where its last offer continued.

    The context lives in one numpy array grown as the output does (doubling), so a round's search is one vectorised
    compare over it and a few over the positions that hold its last token."""

    __slots__ = ("_context", "_length", "_offered_at", "_prompt_length", "_start", "matched")

    def __init__(self, prompt: list[int]) -> None:
        self._context = np.zeros(max(2 * len(prompt), 64), dtype=np.int64)
        self._context[: len(prompt)] = prompt
        self._length = self._prompt_length = len(prompt)
        self._start = -1  # where the last offer began in the context (-1: none yet)
        self._offered_at = 0  # the context's length then
        self.matched = 0  # how many of the context's last tokens the last offer's source matched (up to the cap)

    def offer(self, output: list[int], most: int) -> list[int]:
        """Up to `most` tokens that followed an earlier occurrence of the context's last tokens (`_continuation`
        picks which; none where no run of MIN_NGRAM or more occurs earlier)."""
        self._extend(output)
        if most <= 0:
            return []
        start = self._continuation()
        if start is None:
            return []
        self._start, self._offered_at = start, self._length
        self.matched = self._match_length(start)
        return self._context[start : min(start + most, self._length)].tolist()

    def _match_length(self, start: int) -> int:
        """How many tokens before `start` equal the context's last ones, up to the longest class's length."""
        context, length = self._context, self._length
        matched = 0
        while matched < min(MATCH_CLASSES[-1], start) and context[start - 1 - matched] == context[length - 1 - matched]:
            matched += 1
        return matched

    def _extend(self, output: list[int]) -> None:
        """Take in the output tokens committed since the last call."""
        length = self._prompt_length + len(output)
        if length <= self._length:
            return
        if length > len(self._context):
            grown = np.zeros(2 * length, dtype=np.int64)
            grown[: self._length] = self._context[: self._length]
            self._context = grown
        self._context[self._length : length] = output[self._length - self._prompt_length :]
        self._length = length

    def _continuation(self) -> int | None:
        """Where the context's last tokens occurred before (the position just after them): the expected one if the
        output followed the last offer, else the latest."""
        context, length = self._context, self._length
        if length < MIN_NGRAM + 1:
            return None
        # Positions whose token is the last one (not the last itself), narrowed token by token to those the run of
        # the context's last n tokens ends at: one compare over the context, then over ever fewer candidates.
        ends = np.flatnonzero(context[: length - 1] == context[length - 1])
        longest = None
        for n in range(2, min(MAX_NGRAM, length - 1) + 1):
            ends = ends[ends >= n - 1]
            ends = ends[context[ends - (n - 1)] == context[length - n]]
            if not len(ends):
                break
            if n >= MIN_NGRAM:
                longest = ends
        if longest is None:
            return None
        starts = longest + 1
        expected = self._start + length - self._offered_at if self._start >= 0 else -1
        if expected >= 0 and bool((starts == expected).any()):
            return expected
        return int(starts[-1])


class LookupAcceptance:
    """An engine's per-token acceptance of looked-up drafts, one estimate per match length class: a round that
    accepted a of k drafts is a successes and one failure (none where a == k), as core.policy.SharedPrior counts
    them; evidence fades with each round of its class and with time, so a class that stopped being drafted (its
    estimate fell below the draft model's) is tried again later."""

    __slots__ = ("_classes",)

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._classes = [SharedPrior(PRIOR_ACCEPTANCE, weight=PRIOR_WEIGHT, clock=clock) for _ in MATCH_CLASSES]

    @staticmethod
    def class_of(matched: int) -> int:
        return max(sum(matched >= shortest for shortest in MATCH_CLASSES) - 1, 0)

    def value(self, matched: int) -> float:
        return self._classes[self.class_of(matched)].value

    def observe(self, matched: int, k: int, accepted: int) -> None:
        self._classes[self.class_of(matched)].observe(k, accepted)


@dataclass(slots=True)
class Pace:
    """A row's recent tokens per second, each round priced at what the cost model says it costs (a batch's other rows
    and the machine's load do not move it), each round's weight fading by PACE_DECAY a round. With prompt lookup on,
    the round plan weighs the draft model's rounds against it (core.round_plan rule 2): where copies run fast, the
    tokens a drafted round adds are worth only what copying would have spent on them."""

    tokens: float = 0.0
    seconds: float = 0.0

    def record(self, tokens: int, seconds: float) -> None:
        self.tokens = self.tokens * PACE_DECAY + tokens
        self.seconds = self.seconds * PACE_DECAY + seconds

    @property
    def rate(self) -> float:
        """Tokens per second (0: no round priced yet)."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0
