"""Log-probabilities of emitted tokens, as the target model gave them.

A request with `SamplingParams.logprobs` set (0 to MAX_TOP_LOGPROBS) receives, for every token it is sent, the
natural-log probability of that token under the target's own distribution at its position (log-softmax of the raw
logits: before temperature, top-k and top-p, as vLLM reports by default), and the `logprobs` most likely tokens there.
Accepted draft tokens, a resampled token and the bonus token all come from the verify forward's logits, so a
speculative round reports the same figures plain decoding would (up to the rounding of a wider forward).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_TOP_LOGPROBS = 20


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob) of the most likely tokens, most likely first
    rank: int = 0  # the token's place among the vocabulary, most likely first (1 is the top); 0: not computed
