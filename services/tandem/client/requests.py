"""What a client sends: GenerateRequest and TokenizeRequest built from typed keywords, checked client-side for misuse
(two inputs, an unknown speculation mode) before anything is sent. Values the server checks (temperature ranges,
max_tokens limits) are left to the server, so every client gets the same INVALID_ARGUMENT."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, TypedDict

from tandem.errors import InvalidArgument
from tandem.response_format import wire_format
from tandem.v1 import generation_pb2 as pb

Speculation = Literal["auto", "off"]
ChatMessages = Iterable[tuple[str, str] | Mapping[str, str]]

SPECULATION_MODES = {"auto": pb.SpeculationOptions.MODE_AUTO, "off": pb.SpeculationOptions.MODE_OFF}
READINESS_SERVICE = "tandem.v1.GenerationService"


class GenerateOptions(TypedDict, total=False):
    """build_request's keywords, for the methods that pass them on (kept equal to its signature by a test)."""

    chat: ChatMessages | None
    token_ids: Iterable[int] | None
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    seed: int | None
    stop: str | Sequence[str]
    stop_token_ids: Iterable[int]
    ignore_eos: bool
    speculation: Speculation
    max_k: int | None
    session_id: str
    request_id: str
    n: int
    logprobs: int | None
    prompt_logprobs: int | None
    repetition_penalty: float | None
    presence_penalty: float | None
    frequency_penalty: float | None
    logit_bias: Mapping[int, float] | None
    tools: Iterable[Mapping[str, Any]] | None
    tool_choice: str
    parallel_tool_calls: bool
    response_format: Mapping[str, Any] | None
    priority: int
    prediction: str
    min_tokens: int | None


def build_request(prompt: str | None = None, *, chat: ChatMessages | None = None,
                  token_ids: Iterable[int] | None = None, max_tokens: int | None = None,
                  temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                  min_p: float | None = None, seed: int | None = None, stop: str | Sequence[str] = (),
                  stop_token_ids: Iterable[int] = (),
                  ignore_eos: bool = False, speculation: Speculation = "auto", max_k: int | None = None,
                  session_id: str = "", request_id: str = "", n: int = 1, logprobs: int | None = None,
                  prompt_logprobs: int | None = None, repetition_penalty: float | None = None,
                  presence_penalty: float | None = None, frequency_penalty: float | None = None,
                  logit_bias: Mapping[int, float] | None = None, tools: Iterable[Mapping[str, Any]] | None = None,
                  tool_choice: str = "", parallel_tool_calls: bool = True,
                  response_format: Mapping[str, Any] | None = None, priority: int = 0,
                  prediction: str = "", min_tokens: int | None = None) -> pb.GenerateRequest:
    """A GenerateRequest. Exactly one input: prompt (raw text), chat (the model's chat template is applied: {"role",
    "content"} mappings or (role, content) pairs) or token_ids. None leaves a sampling field unset (the server's
    default: temperature 1, top_p 1, top_k and min_p off, max_tokens 128, no penalties). n: choices for this prompt.
    logprobs: the number (0-20) of most likely alternatives each chunk reports beside the target's log-probability
    of every emitted token; None for none. prompt_logprobs: the same for every prompt token after the first, in each
    choice's first chunk (the prompt is scored whole, not from a session's cache). repetition_penalty (> 1
    discourages tokens already in the context), presence_penalty and frequency_penalty (-2 to 2, over the output)
    and logit_bias ({token id: -100 to 100}) reshape the logits before sampling, as in vLLM and OpenAI. tools (a
    chat's, OpenAI-shaped) are shown to the model by its chat template, and the calls it makes come back parsed in
    the chunks' tool_calls; tool_choice: "" or "auto" (the model decides), "none" (not shown), "required" or
    "function:NAME" (the output begins with a call, of that tool if named); parallel_tool_calls False: at most one
    call, the output ends as it closes. response_format: a structure the output
    follows, in OpenAI's shapes ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": ...,
    "schema": {...}}}, or {"type": "text"} for free text) or tandem's {"type": "regex", "regex": "..."} and
    {"type": "grammar", "grammar": "..."} (Lark or GBNF; the whole output matches it): the output is sampled from
    the target's distribution restricted to the format and ends at a whole match, or at max_tokens (finish reason
    "length"); the server refuses a format it cannot compile (INVALID_ARGUMENT). priority: 0 (the default) or more;
    the gateway runs lower values first, equal ones in arrival order. prediction: text the output is expected to
    repeat in large part (code or a document being edited): where the output matches it, its tokens are verified as
    drafts, so such output comes sooner; the output is the same as without it. min_tokens: no EOS or stop token id
    before this many output tokens (stop strings still end it)."""
    if sum(x is not None for x in (prompt, token_ids, chat)) != 1:
        raise InvalidArgument("input: pass exactly one of prompt, token_ids or chat")
    if speculation not in SPECULATION_MODES:
        raise InvalidArgument(f"speculation: must be one of {', '.join(SPECULATION_MODES)}, got {speculation!r}")
    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p, "seed": seed,
                "max_tokens": max_tokens, "repetition_penalty": repetition_penalty,
                "presence_penalty": presence_penalty, "frequency_penalty": frequency_penalty,
                "logit_bias": dict(logit_bias) if logit_bias else None, "min_tokens": min_tokens}
    request = _wire(
        pb.GenerateRequest,
        request_id=request_id, session_id=session_id,
        stop=[stop] if isinstance(stop, str) else list(stop),  # a lone string is one stop, not its characters
        stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos,
        sampling=_wire(pb.SamplingParams, **{k: v for k, v in sampling.items() if v is not None},
                       response_format=wire_format(response_format)),
        speculation=_wire(pb.SpeculationOptions, mode=SPECULATION_MODES[speculation], max_k=max_k),
        n=n, logprobs=logprobs, prompt_logprobs=prompt_logprobs, priority=priority, prediction=prediction,
    )
    if prompt is not None:
        request.prompt = prompt
    elif token_ids is not None:
        request.token_ids.ids.extend(token_ids)
    else:
        request.chat.CopyFrom(_chat(chat, tools or (), tool_choice))
        request.chat.single_tool_call = not parallel_tool_calls
    if tools and chat is None:
        raise InvalidArgument("tools: only a chat can offer tools")
    return request


def _wire(message_type, **fields):
    """`message_type(**fields)`; a value the wire cannot carry (seed -1 in a uint64, 2.5 tokens) is InvalidArgument
    naming its field, as the server names the fields it refuses, not protobuf's ValueError or TypeError."""
    try:
        return message_type(**fields)
    except (ValueError, TypeError):
        for name, value in fields.items():
            try:
                message_type(**{name: value})
            except (ValueError, TypeError) as exc:
                raise InvalidArgument(f"{name}: {exc}") from None
        raise


def _chat(messages: ChatMessages, tools: Iterable[Mapping[str, Any]] = (), tool_choice: str = "") -> pb.Chat:
    """Messages are (role, content) pairs or OpenAI-shaped mappings (an assistant's `tool_calls`, a tool turn's
    `tool_call_id` and `name`); tools are OpenAI-shaped ({"type": "function", "function": {...}}) or the function
    mappings alone."""
    chat = pb.Chat(tool_choice=tool_choice)
    for message in messages:
        if not isinstance(message, Mapping):
            role, content = message
            chat.messages.add(role=role, content=content)
            continue
        calls = [pb.ToolCall(id=call.get("id", ""), name=call["function"]["name"],
                             arguments_json=_json_text(call["function"].get("arguments", {})))
                 for call in message.get("tool_calls") or ()]
        chat.messages.add(role=message["role"], content=message.get("content") or "", tool_calls=calls,
                          tool_call_id=message.get("tool_call_id", ""), name=message.get("name", ""))
    for tool in tools:
        function = tool.get("function", tool)
        chat.tools.add(name=function["name"], description=function.get("description", ""),
                       parameters_json=_json_text(function.get("parameters", {})))
    return chat


def _json_text(value: Any) -> str:
    """JSON text as the wire carries it: a string is taken as JSON text already."""
    return value if isinstance(value, str) else json.dumps(value)


def build_tokenize_request(prompt: str | None = None, *, chat: ChatMessages | None = None,
                           tools: Iterable[Mapping[str, Any]] = ()) -> pb.TokenizeRequest:
    if (prompt is None) == (chat is None):
        raise InvalidArgument("input: pass exactly one of prompt or chat")
    return pb.TokenizeRequest(prompt=prompt) if prompt is not None else pb.TokenizeRequest(chat=_chat(chat, tools))
