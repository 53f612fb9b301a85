"""GenerateRequest -> a validated, tokenized request; every rejection names the offending field first."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Collection
from dataclasses import dataclass, replace

from jinja2.exceptions import TemplateError

from tandem.core.config import DEFAULT_MAX_TOKENS, OutputFormat, SamplingParams
from tandem.core.formats import check_format, format_tokenizer
from tandem.core.logprobs import MAX_TOP_LOGPROBS
from tandem.engines import ModelLimits
from tandem.errors import ContextLengthExceeded, InvalidArgument, check_in_vocabulary
from tandem.gateway.auth import MAX_PRIORITY
from tandem.gateway.forced_calls import call_format, forced_call_start
from tandem.gateway.tools import offers_tools, template_message, template_tools
from tandem.v1 import generation_pb2 as pb

log = logging.getLogger(__name__)

CHAT_ROLES = ("system", "user", "assistant", "tool")
PROMPT_BYTES_PER_TOKEN = 16  # max_prompt_bytes' default: a prompt of max_prompt_tokens tokens of up to 16 bytes each


@dataclass(slots=True, frozen=True)
class GatewayLimits:
    """Per-request bounds the gateway enforces before anything reaches the engine."""

    max_tokens: int = 4096
    # A request that sends no max_tokens gets this many (at most max_tokens), or what its prompt leaves of the
    # context window if fewer.
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    max_prompt_tokens: int = 8192
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 64
    max_chat_messages: int = 1024
    max_id_chars: int = 128
    max_choices: int = 16  # n
    # Checked before tokenizing or templating: the UTF-8 bytes of a prompt, or of a chat's contents summed.
    # None: max_prompt_tokens * PROMPT_BYTES_PER_TOKEN (the longest legitimate prompt fits).
    max_prompt_bytes: int | None = None
    # One request as it arrives: a gRPC message (grpc.max_receive_message_length), an HTTP body (413 past it).
    max_request_bytes: int = 4 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.max_prompt_bytes is None:
            object.__setattr__(self, "max_prompt_bytes", self.max_prompt_tokens * PROMPT_BYTES_PER_TOKEN)
        for name in self.__slots__:
            if getattr(self, name) < 1:
                raise InvalidArgument(f"{name}: must be at least 1, got {getattr(self, name)}")
        # A default past the largest max_tokens a request may ask for would have every request that sends none
        # refused for a value it never sent.
        object.__setattr__(self, "default_max_tokens", min(self.default_max_tokens, self.max_tokens))


# Added to the priority of the gateway's own background work (the Batch API's requests, canary checks' plain
# decoding): it runs behind every request a client can send (int32 priorities, 0 the least).
BACKGROUND_PRIORITY = MAX_PRIORITY + 1


@dataclass(slots=True, frozen=True)
class PreparedRequest:
    request_id: str
    session_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_k: int | None  # None: the policy decides up to the server's k_max; 0: plain decoding
    n: int = 1  # choices: each runs as its own sequence (gateway.generation)
    tool_names: tuple[str, ...] = ()  # a chat's offered tools: calls are read out of the output (gateway.tools)
    call_start: str = ""  # the start of a call the prompt ends with (a required or named tool_choice)
    single_tool_call: bool = False  # the output ends as its first call closes (parallel_tool_calls false)
    priority: int = 0  # lower runs first (core.engine); a client's are 0 or more, background work's beyond them
    prediction: tuple[int, ...] = ()  # the tokens the output is expected to repeat (core.prediction)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidArgument(message)


def _check_bytes(name: str, size: int, limits: GatewayLimits, refused: type[InvalidArgument] = InvalidArgument) -> None:
    """A prompt past the byte limit is refused before it is tokenized; as `refused` (ContextLengthExceeded for a
    prompt, whose clients trim a conversation on that code, as they do for one past the context in tokens)."""
    if size > limits.max_prompt_bytes:
        raise refused(f"{name}: {size} bytes is more than the limit of {limits.max_prompt_bytes} bytes")


def _utf8_size(text: str, limits: GatewayLimits) -> int:
    """The UTF-8 size of `text`, or a bound past the limit without encoding a huge string."""
    if len(text) > limits.max_prompt_bytes:  # a character is at least one byte
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


def _check_id(name: str, value: str, limits: GatewayLimits) -> None:
    _require(len(value) <= limits.max_id_chars, f"{name}: at most {limits.max_id_chars} characters, got {len(value)}")
    _require(value.isprintable(), f"{name}: must not contain control characters")


def sampling_params(request: pb.GenerateRequest, limits: GatewayLimits, model: ModelLimits) -> SamplingParams:
    sampling = request.sampling

    def value(name: str, default):
        return getattr(sampling, name) if sampling.HasField(name) else default

    max_tokens = value("max_tokens", limits.default_max_tokens)
    if max_tokens > limits.max_tokens and (window := model.context_window) is not None and max_tokens >= window:
        # Past the window whatever the prompt: a client trims or moves to a longer context (OpenAI's words)
        raise ContextLengthExceeded(f"max_tokens: must be between 1 and {limits.max_tokens}, got {max_tokens}. This "
                                    f"model's maximum context length is {window} tokens.")
    _require(1 <= max_tokens <= limits.max_tokens, f"max_tokens: must be between 1 and {limits.max_tokens}, "
             f"got {max_tokens}")
    _require(len(request.stop) <= limits.max_stop_strings,
             f"stop: at most {limits.max_stop_strings} stop strings, got {len(request.stop)}")
    for index, stop in enumerate(request.stop):
        _require(0 < len(stop) <= limits.max_stop_string_chars,
                 f"stop[{index}]: must be 1 to {limits.max_stop_string_chars} characters, got {len(stop)}")
    _require(len(request.stop_token_ids) <= limits.max_stop_token_ids,
             f"stop_token_ids: at most {limits.max_stop_token_ids} ids, got {len(request.stop_token_ids)}")
    check_in_vocabulary("stop_token_ids", request.stop_token_ids, model.vocab_size)
    logprobs = request.logprobs if request.HasField("logprobs") else None
    _require(logprobs is None or 0 <= logprobs <= MAX_TOP_LOGPROBS,
             f"logprobs: must be between 0 and {MAX_TOP_LOGPROBS}, got {logprobs}")
    prompt_logprobs = request.prompt_logprobs if request.HasField("prompt_logprobs") else None
    _require(prompt_logprobs is None or 0 <= prompt_logprobs <= MAX_TOP_LOGPROBS,
             f"prompt_logprobs: must be between 0 and {MAX_TOP_LOGPROBS}, got {prompt_logprobs}")
    check_in_vocabulary("logit_bias", sorted(sampling.logit_bias), model.vocab_size)
    # SamplingParams checks the remaining ranges (temperature, top_p, top_k, min_p, seed, penalties, biases) with
    # field-named messages.
    return SamplingParams(temperature=value("temperature", 1.0), top_p=value("top_p", 1.0), top_k=value("top_k", 0),
                          min_p=value("min_p", 0.0),
                          seed=value("seed", None), max_tokens=max_tokens, stop=tuple(request.stop),
                          stop_token_ids=tuple(request.stop_token_ids), ignore_eos=request.ignore_eos,
                          logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                          repetition_penalty=value("repetition_penalty", 1.0),
                          presence_penalty=value("presence_penalty", 0.0),
                          frequency_penalty=value("frequency_penalty", 0.0),
                          logit_bias=tuple(sorted(sampling.logit_bias.items())),
                          output_format=output_format(sampling), min_tokens=value("min_tokens", 0))


def output_format(sampling: pb.SamplingParams) -> OutputFormat | None:
    """The structure the request asks its output to follow; None for free text (no ResponseFormat, or one with no
    case set). Whether it compiles is checked in `prepare`, which has the tokenizer."""
    if not sampling.HasField("response_format"):
        return None
    wanted = sampling.response_format
    kind = wanted.WhichOneof("format")
    if kind is None:
        return None
    if kind == "json_object":
        _require(wanted.json_object, "response_format.json_object: must be true when set (leave response_format "
                 "unset for free text)")
        return OutputFormat.json_object()
    return OutputFormat(kind, getattr(wanted, kind))


def speculation_max_k(options: pb.SpeculationOptions, model: ModelLimits) -> int | None:
    modes = pb.SpeculationOptions.Mode
    _require(options.mode in modes.values(), f"speculation.mode: unknown value {options.mode}")
    if options.HasField("max_k"):
        _require(0 <= options.max_k <= model.max_k,
                 f"speculation.max_k: must be between 0 and {model.max_k}, got {options.max_k}")
    if options.mode == modes.Value("MODE_OFF"):
        return 0
    return options.max_k if options.HasField("max_k") else None


def prompt_ids(request: pb.GenerateRequest, tokenizer, limits: GatewayLimits, model: ModelLimits) -> list[int]:
    kind = request.WhichOneof("input")
    if kind is None:
        raise InvalidArgument("input: set one of prompt, token_ids or chat")
    if kind == "prompt":
        _require(bool(request.prompt), "prompt: must not be empty")
        ids = encode_prompt(request.prompt, tokenizer, limits)
    elif kind == "token_ids":
        ids = list(request.token_ids.ids)
        _require(bool(ids), "token_ids: must contain at least one id")
        check_in_vocabulary("token_ids", ids, model.vocab_size)
    else:
        ids = chat_ids(request.chat, tokenizer, limits)
    _require(bool(ids), f"{kind}: encodes to no tokens")
    if len(ids) > limits.max_prompt_tokens:  # too long for this server: a client trims it as for the model's window
        raise ContextLengthExceeded(f"{kind}: {len(ids)} tokens is more than the limit of {limits.max_prompt_tokens} "
                                    "(--max-prompt-tokens)")
    return ids


def encode_prompt(prompt: str, tokenizer, limits: GatewayLimits, special_tokens: bool = True) -> list[int]:
    """A prompt's token ids, its size checked first (tokenizing megabytes would hold a core for seconds);
    `special_tokens`: with those the tokenizer adds around a text (a BOS), as a request's prompt gets them."""
    _check_bytes("prompt", _utf8_size(prompt, limits), limits, ContextLengthExceeded)
    return tokenizer.encode(prompt, add_special_tokens=special_tokens)


def chat_ids(chat: pb.Chat, tokenizer, limits: GatewayLimits, generation_prompt: bool = True) -> list[int]:
    """A chat's ids, its template applied; with `generation_prompt`, the assistant's turn opened (as a request's)."""
    messages = chat.messages
    _require(len(messages) > 0, "chat: needs at least one message")
    _require(len(messages) <= limits.max_chat_messages,
             f"chat: at most {limits.max_chat_messages} messages, got {len(messages)}")
    size = sum(_utf8_size(t.name + t.description + t.parameters_json, limits) for t in chat.tools)
    for index, message in enumerate(messages):
        _require(message.role in CHAT_ROLES,
                 f"chat.messages[{index}].role: must be one of {', '.join(CHAT_ROLES)}, got {message.role!r}")
        size += _utf8_size(message.content, limits)
        size += sum(_utf8_size(c.name + c.arguments_json, limits) for c in message.tool_calls)
        if size > limits.max_prompt_bytes:  # before templating: bounded work
            _check_bytes("chat.messages", size, limits, ContextLengthExceeded)
    _require(bool(getattr(tokenizer, "chat_template", None)), "chat: this model's tokenizer has no chat template")
    conversation = [template_message(index, message) for index, message in enumerate(messages)]
    tools = template_tools(chat)
    try:
        # sanitize_control_tokens: a special token's text inside a message ("<|im_end|>") is encoded as plain text;
        # only the template's own control tokens are control tokens (no forged turns).
        ids = tokenizer.apply_chat_template(conversation, tools=tools, tokenize=True,
                                            add_generation_prompt=generation_prompt, sanitize_control_tokens=True,
                                            return_dict=False)
    except TemplateError as exc:  # the template itself rejects the conversation (e.g. roles must alternate)
        raise InvalidArgument(f"chat: the chat template rejected these messages: {exc}") from exc
    except Exception as exc:  # its own text may name the server's files: kept in the log
        log.warning("applying the chat template failed", exc_info=True)
        raise InvalidArgument("chat: the chat template could not be applied to these messages") from exc
    if ids and isinstance(ids[0], list):  # a batch of one
        ids = ids[0]
    if generation_prompt and (start := forced_call_start(chat)):  # the call a required or named tool_choice asks for
        ids = list(ids) + list(tokenizer.encode(start, add_special_tokens=False))
    return list(ids)


def prepare(request: pb.GenerateRequest, tokenizer, limits: GatewayLimits, model: ModelLimits,
            eos_token_ids: Collection[int]) -> PreparedRequest:
    """Validate and tokenize; raises InvalidArgument whose message starts with the bad field's name.
    `eos_token_ids`: the ids the engine ends outputs at, which a response format is compiled with."""
    _check_id("request_id", request.request_id, limits)
    _check_id("session_id", request.session_id, limits)
    n = request.n or 1
    _require(1 <= n <= limits.max_choices, f"n: must be between 1 and {limits.max_choices}, got {request.n}")
    params = sampling_params(request, limits, model)
    max_k = speculation_max_k(request.speculation, model)
    _require(request.priority >= 0, f"priority: must be 0 or more (lower runs first, 0 is the default), got "
                                    f"{request.priority}")
    ids = prompt_ids(request, tokenizer, limits, model)
    if (window := model.context_window) is not None:
        # The window is the target's positions, or its KV budget where that holds fewer (core.runner).
        where = (f"the context window of {window} tokens (the model's, or fewer where this server's KV cache holds "
                 f"fewer: --kv-tokens). This model's maximum context length is {window} tokens")  # (OpenAI's words)
        room = window - len(ids)
        # A prompt that fills the window is the prompt's fault whatever max_tokens says (the default never refuses a
        # prompt that leaves room).
        if room < 1:
            raise ContextLengthExceeded(f"{request.WhichOneof('input')}: its {len(ids)} tokens leave no room for "
                                        f"output in {where}.")
        if not request.sampling.HasField("max_tokens"):
            params = replace(params, max_tokens=min(params.max_tokens, room))
        if params.max_tokens > room:
            raise ContextLengthExceeded(f"max_tokens: the prompt's {len(ids)} tokens plus max_tokens "
                                        f"{params.max_tokens} exceed {where}.")
    request_id = request.request_id or f"req-{uuid.uuid4().hex}"
    offered = request.WhichOneof("input") == "chat" and offers_tools(request.chat)
    tool_names = tuple(tool.name for tool in request.chat.tools) if offered else ()
    call_start = forced_call_start(request.chat) if offered else ""
    field = "response_format"
    if call_start:
        # A required or named tool_choice begins the call's JSON in the prompt, and the call's own format
        # (gateway.forced_calls.call_format) masks the rest of it: no other format can apply, and the call ends the
        # output.
        _require(params.output_format is None, "response_format: cannot combine with a tool_choice that requires a "
                                               "call")
        _require(not params.ignore_eos, "ignore_eos: cannot combine with a tool_choice that requires a call, which "
                                        "ends the output")
        params = replace(params, output_format=call_format(request.chat, tokenizer))
        field = "chat.tools"
    if params.output_format is not None:
        # Compiled here, before any worker sees it, with the llguidance tokenizer the in-process workers share
        # (core.formats keeps one per tokenizer object and EOS ids).
        try:
            check_format(params.output_format, format_tokenizer(tokenizer, eos_token_ids))
        except InvalidArgument as exc:
            raise InvalidArgument(str(exc).replace("response_format:", f"{field}:", 1)) from None
    return PreparedRequest(request_id, request.session_id, ids, params, max_k, n, tool_names, call_start,
                           offered and request.chat.single_tool_call, request.priority,
                           prediction_ids(request.prediction, tokenizer, limits))


def prediction_ids(prediction: str, tokenizer, limits: GatewayLimits) -> tuple[int, ...]:
    """The tokens of a request's predicted output (none for ""), bounded as a prompt is."""
    if not prediction:
        return ()
    _check_bytes("prediction", _utf8_size(prediction, limits), limits)
    return tuple(tokenizer.encode(prediction, add_special_tokens=False))
