"""What a client gets back: the streamed Chunk and Complete messages, and a whole stream collected per choice."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from tandem.v1 import generation_pb2 as pb

FinishReason = Literal["stop", "length", "abort", "tool_calls", "unspecified"]
FINISH_REASONS: dict[int, FinishReason] = {
    pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_TOOL_CALLS: "tool_calls", pb.FINISH_REASON_UNSPECIFIED: "unspecified",
}


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0  # of the prompt's, those the server held cached rather than computed
    accepted_prediction_tokens: int = 0  # of a prediction's tokens, those accepted as drafts
    rejected_prediction_tokens: int = 0  # and those verified and refused


@dataclass(frozen=True, slots=True)
class SpeculationStats:
    """The server's per-choice SpeculationStats (see protos/tandem/v1/generation.proto)."""

    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float = 0.0
    mean_accepted_length: float = 0.0
    fallback_rounds: int = 0
    acceptance_per_position: tuple[float, ...] = ()
    draft_failures: int = 0
    predicted_rounds: int = 0  # rounds that drafted from the request's prediction
    lookup_rounds: int = 0  # rounds that drafted from the request's own context (prompt lookup)
    accepted_lookup_tokens: int = 0
    rejected_lookup_tokens: int = 0

    @classmethod
    def from_proto(cls, stats: pb.SpeculationStats) -> SpeculationStats:
        return cls(stats.rounds, stats.drafted_tokens, stats.accepted_tokens, stats.acceptance_rate,
                   stats.mean_accepted_length, stats.fallback_rounds, tuple(stats.acceptance_per_position),
                   stats.draft_failures, stats.predicted_rounds, stats.lookup_rounds, stats.accepted_lookup_tokens,
                   stats.rejected_lookup_tokens)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first

    @classmethod
    def from_proto(cls, item: pb.TokenLogprob) -> TokenLogprob:
        return cls(item.token_id, item.logprob, tuple((t.token_id, t.logprob) for t in item.top))


@dataclass(slots=True)
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # None unless the request set logprobs
    prompt_logprobs: list[TokenLogprob] | None = None  # the prompt's tokens after the first, if the request asked
    tool_calls: list[pb.ToolCall] = field(default_factory=list)  # the calls the model made (a chat offered tools)
    finish_reason: FinishReason = "unspecified"
    usage: Usage = field(default_factory=Usage)
    speculation: SpeculationStats = field(default_factory=SpeculationStats)


@dataclass(slots=True)
class GenerateResult:
    """A whole Generate stream: one Choice per requested choice, in index order. text, token_ids, finish_reason and
    speculation are the first choice's (all there is with n = 1); usage counts the prompt once and every choice's
    completion tokens (as OpenAI's usage does)."""

    request_id: str
    choices: list[Choice]

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    @property
    def finish_reason(self) -> FinishReason:
        return self.choices[0].finish_reason

    @property
    def speculation(self) -> SpeculationStats:
        return self.choices[0].speculation

    @property
    def usage(self) -> Usage:
        first = self.choices[0].usage
        return Usage(first.prompt_tokens, sum(c.usage.completion_tokens for c in self.choices),
                     first.cached_prompt_tokens, sum(c.usage.accepted_prediction_tokens for c in self.choices),
                     sum(c.usage.rejected_prediction_tokens for c in self.choices))


class Collector:
    """Assembles a GenerateResult from streamed items; feed it while streaming (as `tandem generate` does, printing
    text as it comes) or let generate_result do it."""

    def __init__(self, logprobs: bool = False, prompt_logprobs: bool = False) -> None:
        self.logprobs, self.prompt_logprobs = logprobs, prompt_logprobs
        self.choices: dict[int, Choice] = {}
        self.completes: dict[int, pb.Complete] = {}
        self.request_id = ""

    def _choice(self, index: int) -> Choice:
        if index not in self.choices:
            self.choices[index] = Choice(index, logprobs=[] if self.logprobs else None,
                                         prompt_logprobs=[] if self.prompt_logprobs else None)
        return self.choices[index]

    def add(self, item: pb.Chunk | pb.Complete) -> None:
        choice = self._choice(item.index)
        if isinstance(item, pb.Chunk):
            choice.text += item.text
            choice.token_ids.extend(item.token_ids)
            choice.tool_calls.extend(item.tool_calls)
            if choice.logprobs is not None:
                choice.logprobs.extend(TokenLogprob.from_proto(x) for x in item.logprobs)
            if choice.prompt_logprobs is not None:
                choice.prompt_logprobs.extend(TokenLogprob.from_proto(x) for x in item.prompt_logprobs)
            return
        self.completes[item.index] = item
        self.request_id = self.request_id or item.request_id
        choice.finish_reason = FINISH_REASONS.get(item.finish_reason, "unspecified")
        choice.usage = Usage(item.usage.prompt_tokens, item.usage.completion_tokens, item.usage.cached_prompt_tokens,
                             item.usage.accepted_prediction_tokens, item.usage.rejected_prediction_tokens)
        choice.speculation = SpeculationStats.from_proto(item.speculation)

    def result(self) -> GenerateResult:
        if not self.completes or set(self.completes) != set(self.choices):
            missing = sorted(set(self.choices) - set(self.completes)) or [0]
            raise RuntimeError(f"the stream ended without a Complete message for choice {missing[0]}")
        return GenerateResult(self.request_id, [self.choices[i] for i in sorted(self.choices)])


def _unwrap(response: pb.GenerateResponse) -> pb.Chunk | pb.Complete:
    return response.chunk if response.WhichOneof("kind") == "chunk" else response.complete


def _first_choice(items: Iterable[pb.Chunk | pb.Complete]) -> tuple[str, pb.Complete]:
    parts: list[str] = []
    complete = None
    for item in items:
        if item.index != 0:
            continue
        if isinstance(item, pb.Chunk):
            parts.append(item.text)
        else:
            complete = item
    if complete is None:
        raise RuntimeError("the stream ended without a Complete message")
    return "".join(parts), complete
