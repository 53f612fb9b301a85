"""What the engine holds for each request (Sequence: its tokens, its policy, how far each worker has seen it) and
what it hands back: a step's new tokens per request (StepOutput) and a finished request (GenerationResult)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tandem.core import policy
from tandem.core.config import SamplingParams
from tandem.core.logprobs import TokenLogprob
from tandem.core.prediction import Prediction
from tandem.core.prompt_lookup import Pace, PromptLookup
from tandem.core.protocol import RowOrder
from tandem.core.stats import RequestStats, SpeculationReport
from tandem.core.stops import StopChecker


@dataclass(slots=True)
class Sequence:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    stop: StopChecker
    policy: policy.PolicyState
    output: list[int] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
    draft_synced: int = 0
    verify_synced: int = 0
    finish_reason: str | None = None
    text_cut: int | None = None
    max_k: int | None = None  # per-request cap on drafted tokens per round; 0 is plain decoding
    session_id: str = ""  # workers keep a finished sequence's cache for the session's next request
    cache_scope: str = ""  # whose sequences' cached prefixes this one may start from (a tenant)
    priority: int = 0  # lower runs first (the engine's step order); equal ones in arrival order
    arrival: float = field(default_factory=time.time)  # wall clock: workers order every gateway's rows by it
    prefill_started: bool = False  # the verifier holds part of the prompt uncached (a chunked prefill goes on)
    logprobs: list[TokenLogprob] | None = None  # aligned with output when the request asked (params.logprobs)
    prompt_logprobs: list[TokenLogprob] | None = None  # the prompt's tokens after the first, once scored
    prediction: Prediction | None = None  # the output the request predicted, drafted where it matches
    lookup: PromptLookup | None = None  # without a prediction, with prompt lookup on: its context's n-gram search
    pace: Pace | None = None  # with lookup: its recent tokens per second, which the draft model's rounds must beat

    def offer(self, most: int) -> list[int]:
        """Up to `most` free drafts to follow the output: its prediction's, else its context's (prompt lookup)."""
        if self.prediction is not None:
            return self.prediction.offer(self.output, most)
        return self.lookup.offer(self.output, most) if self.lookup is not None else []

    @property
    def order(self) -> RowOrder:
        """Its place among the sequences of every caller of a worker whose cache is full (workers.kv_order)."""
        return RowOrder(self.priority, self.arrival)

    @property
    def scores_prompt(self) -> bool:
        """Whether its next verification scores the prompt (asked for, not received yet)."""
        return self.params.prompt_logprobs is not None and self.prompt_logprobs is None

    @property
    def context(self) -> list[int]:
        return self.prompt + self.output

    def prefilling(self, chunk: int) -> bool:
        """Whether the prompt may still need more than `chunk` tokens cached before its first round (the verifier
        may hold a session's prefix already: it prefills only what it lacks)."""
        return not self.output and (self.prefill_started or len(self.prompt) - self.verify_synced - 1 > chunk)

    def backlog(self, k: int, catch_up: int) -> list[int]:
        """The context the drafter has not seen: all of it for a drafting row, at most `catch_up` tokens for a row
        that only catches up."""
        unseen = self.context[self.draft_synced :]
        return unseen if k > 0 else unseen[:catch_up]

    @property
    def admitted(self) -> bool:
        """Whether the verifier holds (part of) this sequence's cache."""
        return bool(self.verify_synced or self.prefill_started)


@dataclass(slots=True)
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None  # aligned with new_token_ids when the request asked, else None
    prompt_logprobs: list[TokenLogprob] | None = None  # in the request's first output, when it asked


@dataclass(slots=True)
class GenerationResult:
    request_id: str
    token_ids: list[int]
    text: str | None
    finish_reason: str
    stats: SpeculationReport
    logprobs: list[TokenLogprob] | None = None  # aligned with token_ids when the request asked, else None
    prompt_logprobs: list[TokenLogprob] | None = None  # the prompt's tokens after the first, when it asked
