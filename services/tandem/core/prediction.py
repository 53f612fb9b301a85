"""Drafts from a request's predicted output (OpenAI's Predicted Outputs): free drafts where the output repeats it.

A client that expects its output to repeat known text (code being edited, a document being revised) sends that text
as `prediction`. Where the output so far matches part of it, the tokens that follow there are proposed as the
round's drafts, with no draft model: the target verifies them in one forward, as it verifies a draft model's, so the
output is exactly what it would be without the prediction. A greedy or seeded row accepts a drafted token where it
equals the target's choice; an unseeded sampled row accepts it with probability min(1, p/q) where q is one-hot on
the predicted token (core.rejection), that is with probability p(token), and resamples from p without it otherwise.

Where to continue: the first round starts at the prediction's first token; later rounds look up the output's last
few tokens (the longest n-gram of up to NGRAM that occurs in the prediction) and continue where the output stands if
it followed the prediction since the last offer, else after their first occurrence at or after where the last offer
began, so that after an edit the drafts pick the prediction up where the output rejoins it. How many: the k of
the offered tokens that makes the most tokens per second of the target's forward time at the acceptance the
request's drafts have had (core.policy.expected_tokens), a drafted block being free.
"""

from __future__ import annotations

import numpy as np

from tandem.core.costs import CostModel
from tandem.core.policy import expected_tokens
from tandem.core.protocol import DraftDist, DraftProposal

NGRAM = 3  # the longest run of the output's last tokens looked up in the prediction
TOKEN_BITS = 21  # a token id's bits in an n-gram's key: NGRAM of them fit 64 (vocabularies up to 2M ids)
PRIOR_ACCEPTANCE = 0.9  # before a request's predicted drafts are measured: predictions are meant to be mostly right
PRIOR_WEIGHT = 4.0  # in drafted tokens
MOST_ACCEPTANCE = 0.999  # free drafts are never priced as certain, however well they have done


class Prediction:
    """A request's predicted output as token ids, indexed by the n-grams it holds: per n, the n-grams packed into one
    integer each (TOKEN_BITS a token), sorted, beside the position just after each occurrence. Built with numpy on the
    engine's thread when the request is added: about 7 ms for 32k tokens on 2 cores, where a dict of tuples took
    60-85 ms, a pause every running stream would wait out."""

    __slots__ = ("_ends", "_keys", "_offered_at", "_start", "tokens")

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = list(tokens)
        ids = np.asarray(self.tokens, dtype=np.uint64)
        if len(ids) and int(ids.max()) >> TOKEN_BITS:
            raise ValueError(f"prediction: token ids must be below 2**{TOKEN_BITS}")
        self._keys: list[np.ndarray] = []  # [n - 1]: the n-grams' keys, ascending
        self._ends: list[np.ndarray] = []  # [n - 1]: where each ends, in the keys' order (ascending within a key)
        for n in range(1, NGRAM + 1):
            count = max(len(ids) - n + 1, 0)
            keys = np.zeros(count, dtype=np.uint64)
            for j in range(n):
                keys = (keys << np.uint64(TOKEN_BITS)) | ids[j : j + count]
            order = np.argsort(keys, kind="stable")
            self._keys.append(keys[order])
            self._ends.append(order + n)
        self._start = 0  # where the last offer continued from
        self._offered_at = 0  # the output's length then

    def offer(self, output: list[int], most: int) -> list[int]:
        """Up to `most` predicted tokens to follow `output` (none where the output's last tokens are not in the
        prediction, or it has nothing after them)."""
        if most <= 0:
            return []
        start = self._continuation(output)
        if start is None:
            return []
        self._start, self._offered_at = start, len(output)
        return self.tokens[start : start + most]

    def _after(self, gram: list[int]) -> np.ndarray:
        """Every position just after an occurrence of `gram` in the prediction, ascending."""
        if any(token >> TOKEN_BITS for token in gram):
            return self._ends[0][:0]
        key = 0
        for token in gram:
            key = (key << TOKEN_BITS) | token
        keys = self._keys[len(gram) - 1]
        lo, hi = np.searchsorted(keys, np.uint64(key), "left"), np.searchsorted(keys, np.uint64(key), "right")
        return self._ends[len(gram) - 1][lo:hi]

    def _continuation(self, output: list[int]) -> int | None:
        """Where in the prediction `output` goes on: where it would be had it followed the prediction since the last
        offer, if its last tokens are there (inside a run of repeated tokens, the first occurrence after the last
        start would fall short); else the occurrence of its last tokens at or after the last start (after an edit:
        where the output rejoins the prediction), else the last one."""
        if not output:
            return 0
        expected = self._start + len(output) - self._offered_at
        for n in range(min(NGRAM, len(output)), 0, -1):
            after = self._after(output[-n:])
            if len(after):
                at = int(np.searchsorted(after, expected))
                if at < len(after) and after[at] == expected:
                    return expected
                at = int(np.searchsorted(after, self._start))
                return int(after[at] if at < len(after) else after[-1])
        return None


def predicted_acceptance(accepted: int, rejected: int) -> float:
    """The share of a request's predicted drafts accepted, from PRIOR_ACCEPTANCE towards what its rounds measured."""
    return (accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (accepted + rejected + PRIOR_WEIGHT)


def predicted_k(offered: int, acceptance: float, costs: CostModel) -> int:
    """How many of `offered` free drafts to verify: the most expected tokens per second of target forward (0 where a
    plain forward does better)."""
    if offered <= 0:
        return 0
    return max((free_draft_rate(acceptance, k, costs), k) for k in range(offered + 1))[1]


def free_draft_rate(acceptance: float, k: int, costs: CostModel) -> float:
    """Expected tokens per second of a round verifying k drafts that cost nothing to make (k 0: plain decoding)."""
    # Widths are priced within those timed, one outside them as the nearest timed: extrapolated along the line
    # through the timed ones (from width 1 alone: in proportion to its tokens, which a memory-bound forward is far
    # below), a target-only engine, never calibrated, would never try a wider one, and a drafting engine that never
    # timed width 1 could price it at nothing. Each such round times its width (the engine's
    # CostModel.observe_verify), and later rounds read that.
    timed = sorted(costs.verify) or [1]
    width = min(max(k + 1, timed[0]), timed[-1])
    return expected_tokens(min(acceptance, MOST_ACCEPTANCE), k) / costs.forward_time(width)


def predicted_proposal(tokens: list[int], sampled: bool) -> DraftProposal:
    """The predicted tokens as a proposal; an unseeded sampled row's carries the one-hot q they were 'drawn' from."""
    if not sampled or not tokens:
        return DraftProposal(list(tokens))
    ids = np.asarray(tokens, dtype=np.int64).reshape(-1, 1)
    return DraftProposal(list(tokens), DraftDist(ids, np.ones(ids.shape, dtype=np.float32)))
