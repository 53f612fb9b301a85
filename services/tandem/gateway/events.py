"""What the generate path yields and raises, whatever the transport: choice events, and failures by kind.

A request streams `ChoiceDelta`s (new text and tokens of one choice) and, as each choice's last event, a
`ChoiceEnd`. Failures are the gateway's typed errors, named here as gRPC status codes (the names telemetry records
as error.type); each transport maps a name to its own status.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.core.logprobs import TokenLogprob
from tandem.core.stats import SpeculationReport
from tandem.errors import BackendUnavailable, InvalidArgument, TandemError
from tandem.gateway.tools import ToolCall

NOT_LOADED = "not ready: the engine is still loading"
DRAINING = "draining: this server is shutting down"


@dataclass(slots=True, frozen=True)
class ChoiceDelta:
    """New tokens of one choice: text never splits a character or shows a stop string."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for logprobs
    tool_calls: tuple[ToolCall, ...] = ()  # calls completed here (a chat offered tools); `text` leaves them out
    prompt_logprobs: list[TokenLogprob] | None = None  # in a choice's first delta, when the request asked for them
    prompt_token_ids: list[int] | None = None  # in a choice's first delta: the prompt as the model read it


@dataclass(slots=True, frozen=True)
class ChoiceEnd:
    """The last event of one choice."""

    index: int
    finish_reason: str  # tandem.core.stops FINISH_*: "stop", "length" or "abort"; or "tool_calls" (gateway.tools)
    prompt_tokens: int
    completion_tokens: int
    stats: SpeculationReport  # what the request's speculation did
    request_id: str


Event = ChoiceDelta | ChoiceEnd


class QueueFull(TandemError):
    """Too many requests queued or running; retry later."""


class EngineUnavailable(TandemError):
    """The loop is not running, is draining, or its engine is stalled."""


class EngineFailed(TandemError):
    """The engine raised or stalled while this request was in flight."""


class TenantBusy(QueueFull):
    """The tenant already holds its limit of requests in flight: its key's max_concurrency, or its share of the
    gateway's queue (RESOURCE_EXHAUSTED / 429, as a full queue)."""


ERROR_CODES: dict[type[Exception], str] = {
    InvalidArgument: "INVALID_ARGUMENT",
    QueueFull: "RESOURCE_EXHAUSTED",
    EngineUnavailable: "UNAVAILABLE",
    BackendUnavailable: "UNAVAILABLE",
    EngineFailed: "INTERNAL",
}
FAILURES = tuple(ERROR_CODES)


def error_code(exc: Exception) -> str:
    return next(code for kind, code in ERROR_CODES.items() if isinstance(exc, kind))
