"""OpenAI request bodies (chat completions, completions) as pydantic models, with tandem's extra fields.

The models check types only; ranges are checked once, by the gateway's own validation (tandem.gateway.validate,
SamplingParams), so the HTTP and gRPC APIs refuse the same values with the same messages. Unknown fields are
ignored, as OpenAI-compatible servers do, but OpenAI features tandem does not implement are refused when a request
actually uses them (`unsupported`), rather than silently giving different output.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, StrictBool, StrictInt

from tandem.gateway.openai.errors import bad_request


def _none_is_false(value: object) -> object:
    return False if value is None else value


def _none_is_true(value: object) -> object:
    return True if value is None else value


# A flag OpenAI's schema marks nullable: null means the default, false (clients that send every field send it).
Flag = Annotated[StrictBool, BeforeValidator(_none_is_false)]
TrueFlag = Annotated[StrictBool, BeforeValidator(_none_is_true)]  # the same, for a flag whose default is true


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: Flag = False


class ContentPart(_Body):
    type: str
    text: str | None = None


class Prediction(_Body):
    """OpenAI's Predicted Outputs: text the output is expected to repeat (core.prediction)."""

    type: Literal["content"]
    content: str | list[ContentPart]


class FunctionCall(_Body):
    name: str
    arguments: str = "{}"  # a JSON object, in JSON text


class ToolCallIn(_Body):
    """A call an earlier assistant turn made, sent back with the conversation."""

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn's
    tool_call_id: str | None = None  # a tool turn's: the call it answers


class FunctionSpec(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema object


class ToolSpec(_Body):
    type: Literal["function"] = "function"
    function: FunctionSpec


class _Generate(_Body):
    """Fields both endpoints take: OpenAI's sampling fields, then tandem's extras (sent as `extra_body`)."""

    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    n: StrictInt | None = None
    stream: Flag = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    service_tier: str | None = None  # "flex" runs at the largest priority (gateway.openai.convert)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's form) -> bias
    # tandem's extras, like vLLM's extra sampling fields.
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: Flag = False
    stop_token_ids: list[StrictInt] | None = None
    speculation: Literal["auto", "off"] | None = None
    max_k: StrictInt | None = None
    session_id: str | None = None
    request_id: str | None = None
    return_token_ids: Flag = False  # vLLM's field: each choice (and streamed chunk) carries its token ids
    # Structured outputs (gateway.openai.formats): OpenAI's response_format, or vLLM's structured_outputs.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    prompt_logprobs: StrictInt | None = None  # vLLM's: the prompt's tokens' logprobs, whole responses only
    priority: StrictInt | None = None  # vLLM's: lower runs first; here 0 (the default) or more
    # OpenAI's Predicted Outputs, which OpenAI takes on chat completions; here on completions and responses as well.
    prediction: Prediction | None = None
    # vLLM's fields before structured_outputs replaced them: refused by name, never silently ignored.
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # vLLM's sampling extras tandem does not follow, each refused when set to other than its default: ignored, they
    # would give other output than the client asked for.
    min_tokens: StrictInt | None = None  # vLLM's: no EOS or stop token id before this many tokens
    use_beam_search: Any = None
    bad_words: Any = None
    allowed_token_ids: Any = None
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None
    truncate_prompt_tokens: Any = None

    def unsupported(self) -> list[str]:
        """Fields set to something tandem cannot honour."""
        differs = {"use_beam_search": bool(self.use_beam_search),
                   "bad_words": bool(self.bad_words), "allowed_token_ids": bool(self.allowed_token_ids),
                   "include_stop_str_in_output": bool(self.include_stop_str_in_output),
                   "skip_special_tokens": self.skip_special_tokens is False,
                   "truncate_prompt_tokens": self.truncate_prompt_tokens is not None}
        return [name for name, set_ in differs.items() if set_]

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_Generate):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: Flag = False
    top_logprobs: StrictInt | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Any = None  # "auto" (the default with tools), "none", "required" or {"type": "function", ...}
    parallel_tool_calls: StrictBool | None = None  # false: at most one call, the output ends as it closes
    functions: list[Any] | None = None
    function_call: Any = None  # the legacy functions' choice
    modalities: list[str] | None = None  # output modalities: text is the only one served
    audio: Any = None  # audio output's voice and format
    web_search_options: Any = None  # a web search before answering: none here
    continue_final_message: Any = None  # vLLM's: the last (assistant) message continued rather than answered
    add_generation_prompt: Any = None  # vLLM's: false leaves the assistant's turn unopened

    def unsupported(self) -> list[str]:
        bad = super().unsupported() + (["functions"] if self.functions else [])
        bad += ["function_call"] if self.function_call not in (None, "auto", "none") else []
        bad += ["modalities"] if self.modalities is not None and set(self.modalities) - {"text"} else []
        bad += ["audio"] if self.audio is not None else []
        bad += ["web_search_options"] if self.web_search_options is not None else []
        bad += ["continue_final_message"] if self.continue_final_message else []
        bad += ["add_generation_prompt"] if self.add_generation_prompt is False else []
        if self.tool_choice not in (None, "auto", "none", "required") and self.named_tool() is None:
            bad.append("tool_choice")
        return bad

    def named_tool(self) -> str | None:
        """The function a tool_choice of OpenAI's {"type": "function", "function": {"name": ...}} names."""
        choice = self.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
            name = choice["function"].get("name")
            return name if isinstance(name, str) else None
        return None


class CompletionRequest(_Generate):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    logprobs: StrictInt | None = None
    echo: Flag = False
    suffix: str | None = None
    best_of: StrictInt | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported() + (["suffix"] if self.suffix else [])
        return bad + (["best_of"] if self.best_of not in (None, 1) else [])


class ResponsesRequest(_Generate):
    """OpenAI's Responses API (POST /v1/responses): the conversation comes in `input`, after the stored response
    `previous_response_id` names, if any (gateway.openai.responses_input turns it into a chat)."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: StrictInt | None = None
    tools: list[dict[str, Any]] | None = None  # flat function tools: {"type": "function", "name", "parameters"}
    tool_choice: Any = None  # "auto", "none", "required" or {"type": "function", "name": ...}
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    top_logprobs: StrictInt | None = None
    include: list[str] | None = None
    store: StrictBool | None = None
    parallel_tool_calls: StrictBool | None = None
    metadata: dict[str, Any] | None = None
    truncation: str | None = None
    previous_response_id: str | None = None
    # What a server without conversations, hosted tools or reasoning cannot honour: refused by name when used.
    background: StrictBool | None = None  # run on after the answer (gateway.openai.background); needs `store`
    conversation: Any = None  # a conversation's id, or {"id": ...} (gateway.openai.conversations)
    prompt: Any = None
    reasoning: dict[str, Any] | None = None

    def conversation_id(self) -> str | None:
        """The conversation `conversation` names: its id, or {"id": ...}; None without one."""
        given = self.conversation
        if isinstance(given, dict):
            given = given.get("id")
        if given is not None and not (isinstance(given, str) and given):
            raise bad_request("conversation: a conversation's id, or {\"id\": ...}", "conversation")
        return given

    def unsupported(self) -> list[str]:
        bad = [name for name in ("prompt",) if getattr(self, name)]
        bad += ["truncation"] if self.truncation not in (None, "disabled", "auto") else []
        bad += ["reasoning"] if self.reasoning and any(v is not None for v in self.reasoning.values()) else []
        return bad + (["n"] if self.n not in (None, 1) else [])


class InputTokensRequest(ResponsesRequest):
    """POST /v1/responses/input_tokens: a response's body, its input counted rather than answered; `input` may be left
    out where previous_response_id gives the conversation."""

    input: str | list[dict[str, Any]] | None = None
