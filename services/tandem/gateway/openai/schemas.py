"""OpenAI request bodies (chat completions, completions) as pydantic models, with tandem's extra fields.

The models check types only; ranges are checked once, by the gateway's own validation (tandem.gateway.validate,
SamplingParams), so the HTTP and gRPC APIs refuse the same values with the same messages. Unknown fields are
ignored, as OpenAI-compatible servers do, but OpenAI features tandem does not implement are refused when a request
actually uses them (`unsupported`), rather than silently giving different output.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: StrictBool = False


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class _Generate(_Body):
    """Fields both endpoints take: OpenAI's sampling fields, then tandem's extras (sent as `extra_body`)."""

    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    n: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's form) -> bias
    # tandem's extras, like vLLM's extra sampling fields.
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    speculation: Literal["auto", "off"] | None = None
    max_k: StrictInt | None = None
    session_id: str | None = None
    request_id: str | None = None
    return_token_ids: StrictBool = False  # vLLM's field: each choice (and streamed chunk) carries its token ids

    def unsupported(self) -> list[str]:
        """Fields set to something tandem cannot honour."""
        return []

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_Generate):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported() + [name for name in ("tools", "functions") if getattr(self, name)]
        if self.tool_choice not in (None, "none"):
            bad.append("tool_choice")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            bad.append("response_format")
        return bad


class CompletionRequest(_Generate):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: str | None = None
    best_of: StrictInt | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported() + (["echo"] if self.echo else []) + (["suffix"] if self.suffix else [])
        return bad + (["best_of"] if self.best_of not in (None, 1) else [])
