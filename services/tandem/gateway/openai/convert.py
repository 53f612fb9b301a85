"""OpenAI request bodies -> tandem.v1 GenerateRequest, the message the gateway's generation path takes.

Only shapes are translated here; values are checked by the gateway's validation (the same as gRPC requests get),
whose messages name gRPC fields: RENAMES_* map those names back to the body's fields for the error's `param`.
"""

from __future__ import annotations

import json

from tandem.engines import display_name
from tandem.gateway.auth import MAX_PRIORITY
from tandem.gateway.openai.errors import bad_request, model_not_found
from tandem.gateway.openai.formats import response_format
from tandem.gateway.openai.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, _Generate
from tandem.gateway.tools import NAMED
from tandem.v1 import generation_pb2 as pb

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
SEED_LIMIT = 2**63  # SamplingParams' range; the wire field is uint64
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")  # OpenAI's; only flex runs differently here
FLEX_PRIORITY = MAX_PRIORITY  # flex processing: the largest priority a client may send (behind any other, or level)


def served_tier(body: _Generate) -> str:
    """The service tier a request runs in, as its response reports it: flex where it asked for flex, else default
    (tandem has no faster tier to give "priority" or "scale")."""
    return "flex" if body.service_tier == "flex" else "default"


def _priority(body: _Generate) -> int | None:
    if body.service_tier is not None and body.service_tier not in SERVICE_TIERS:
        raise bad_request(f"service_tier: must be one of {', '.join(SERVICE_TIERS)}, got {body.service_tier!r}",
                          "service_tier")
    if body.service_tier != "flex":
        return _int32("priority", body.priority)
    if body.priority is not None:
        raise bad_request(f"priority: cannot combine with service_tier flex, which runs the request at priority "
                          f"{FLEX_PRIORITY}", "priority")
    return FLEX_PRIORITY
# The developer role is OpenAI's newer name for system instructions; chat templates know only "system".
ROLE_ALIASES = {"developer": "system"}
SPECULATION_MODES = {"auto": pb.SpeculationOptions.MODE_AUTO, "off": pb.SpeculationOptions.MODE_OFF}

_COMMON_RENAMES = {"speculation.max_k": "max_k", "speculation.mode": "speculation"}
CHAT_RENAMES = {**_COMMON_RENAMES, "chat.messages": "messages", "chat.tools": "tools",
                "chat.tool_choice": "tool_choice", "chat": "messages", "input": "messages", "logprobs": "top_logprobs"}
COMPLETION_RENAMES = {**_COMMON_RENAMES, "token_ids": "prompt", "input": "prompt"}


def _int32(name: str, value: int | None) -> int | None:
    """The wire's int32 fields would raise on a value past their range; refuse it with the field's name instead.
    Narrower ranges are the gateway validation's to check."""
    if value is not None and not INT32_MIN <= value <= INT32_MAX:
        raise bad_request(f"{name}: must be between {INT32_MIN} and {INT32_MAX}, got {value}", name)
    return value


def _choices(n: int | None) -> int:
    """The wire's n (0: one choice); an explicit 0 is refused, as OpenAI refuses it."""
    if n is not None and n < 1:
        raise bad_request(f"n: must be at least 1, got {n}", "n")
    return _int32("n", n) or 0


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias, keyed by token ids written as strings, as the wire's map of ids."""
    ids = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias: keys must be token ids, got {key!r}", "logit_bias") from None
        ids[_int32("logit_bias", token)] = value
    return ids


def _refuse_unsupported(body: _Generate) -> None:
    if fields := body.unsupported():
        raise bad_request(f"{fields[0]}: not supported by this server", fields[0])


def _common(body: _Generate, request_id: str, max_tokens: int | None, logprobs: int | None) -> pb.GenerateRequest:
    _refuse_unsupported(body)
    if body.seed is not None and not 0 <= body.seed < SEED_LIMIT:
        raise bad_request(f"seed: must be between 0 and {SEED_LIMIT - 1}, got {body.seed}", "seed")
    sampling = pb.SamplingParams(max_tokens=_int32("max_tokens", max_tokens), top_k=_int32("top_k", body.top_k),
                                 seed=body.seed, temperature=body.temperature, top_p=body.top_p, min_p=body.min_p,
                                 repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
                                 frequency_penalty=body.frequency_penalty, logit_bias=_logit_bias(body.logit_bias),
                                 response_format=response_format(body),
                                 min_tokens=_int32("min_tokens", body.min_tokens))
    speculation = pb.SpeculationOptions(mode=SPECULATION_MODES[body.speculation or "auto"],
                                        max_k=_int32("max_k", body.max_k))
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    stop_token_ids = [_int32(f"stop_token_ids[{i}]", t) for i, t in enumerate(body.stop_token_ids or [])]
    if body.prompt_logprobs is not None and body.stream:
        raise bad_request("prompt_logprobs: not supported with stream", "prompt_logprobs")
    prediction = _prediction(body.prediction.content) if body.prediction is not None else ""
    return pb.GenerateRequest(request_id=request_id, session_id=body.session_id or "", sampling=sampling,
                              stop=stop, stop_token_ids=stop_token_ids, speculation=speculation,
                              ignore_eos=body.ignore_eos, n=_choices(body.n),
                              logprobs=_int32("logprobs", logprobs),
                              prompt_logprobs=_int32("prompt_logprobs", body.prompt_logprobs),
                              priority=_priority(body), prediction=prediction)


def chat_request(body: ChatCompletionRequest, request_id: str) -> pb.GenerateRequest:
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs: requires logprobs to be true", "top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    # max_completion_tokens is OpenAI's newer name for max_tokens; it wins when both are sent.
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    request = _common(body, request_id, max_tokens, logprobs)
    messages = [_message(i, m) for i, m in enumerate(body.messages)]
    tools = [pb.Tool(name=t.function.name, description=t.function.description or "",
                     parameters_json=json.dumps(t.function.parameters or {})) for t in body.tools or ()]
    named = body.named_tool()
    choice = f"{NAMED}{named}" if named is not None else body.tool_choice or ""
    request.chat.CopyFrom(pb.Chat(messages=messages, tools=tools, tool_choice=choice,
                                  single_tool_call=body.parallel_tool_calls is False))
    return request


def _prediction(content: str | list) -> str:
    """A prediction's text: a string, or its text parts one after another."""
    return content if isinstance(content, str) else _text_parts(content, "prediction.content", "")


def _message(index: int, message: ChatMessage) -> pb.ChatMessage:
    if message.content is None and message.role != "assistant":  # only an assistant turn (its calls) may have none
        param = f"messages[{index}].content"
        raise bad_request(f"{param}: a {message.role} message needs content", param)
    calls = [pb.ToolCall(id=call.id, name=call.function.name, arguments_json=call.function.arguments)
             for call in message.tool_calls or ()]
    return pb.ChatMessage(role=ROLE_ALIASES.get(message.role, message.role), content=_content(index, message.content),
                          tool_calls=calls, tool_call_id=message.tool_call_id or "", name=message.name or "")


def _content(index: int, content) -> str:
    """A message's text: a string, or its text parts joined by newlines (as vLLM joins them)."""
    if content is None or isinstance(content, str):
        return content or ""
    return _text_parts(content, f"messages[{index}].content", "\n")


def _text_parts(parts: list, param: str, separator: str) -> str:
    """The text of content parts, joined by `separator`; a 400 naming `param` for a part that is not text."""
    for part in parts:
        if part.type != "text":
            raise bad_request(f"{param}: only text parts are supported, got type {part.type!r}", param)
        if part.text is None:
            raise bad_request(f"{param}: a text part needs its text", param)
    return separator.join(part.text for part in parts)


def scores_only(body: object) -> bool:
    """A completion of max_tokens 0 with echo: its prompt back, with its logprobs where asked, and no output."""
    return isinstance(body, CompletionRequest) and body.max_tokens == 0 and bool(body.echo)


def completion_requests(body: CompletionRequest, request_id: str) -> list[pb.GenerateRequest]:
    """One request per prompt of the body (a string, token ids, or a batch of either). A batch's prompt i runs as
    `<request_id>/p<i>`, and only the first keeps the session (a session's cache serves one sequence at a time)."""
    prompts = body.prompt
    batch = isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], str | list)
    prompts = prompts if batch else [prompts]
    max_tokens = body.max_tokens
    if scores_only(body):  # OpenAI's legacy scoring: the prompt's forward gives a token anyway, left out
        max_tokens = 1
    elif max_tokens == 0:
        raise bad_request("max_tokens: 0 only with echo (the prompt echoed and scored, nothing generated); else at "
                          "least 1", "max_tokens")
    requests = []
    for index, prompt in enumerate(prompts):
        request = _common(body, request_id if len(prompts) == 1 else f"{request_id}/p{index}", max_tokens,
                          body.logprobs)
        if index:
            request.session_id = ""
        if body.echo and body.logprobs is not None:  # the echoed prompt's tokens get theirs too
            request.prompt_logprobs = max(request.logprobs, request.prompt_logprobs)
        if isinstance(prompt, str):
            request.prompt = prompt
        else:
            name = f"prompt[{index}]" if batch else "prompt"
            for i, token in enumerate(prompt):
                if not isinstance(token, int) or not 0 <= token <= INT32_MAX:
                    raise bad_request(f"{name}[{i}]: token id {token!r} is out of range", "prompt")
            request.token_ids.CopyFrom(pb.TokenIds(ids=prompt))
        requests.append(request)
    return requests


def chat_requests(body: ChatCompletionRequest, request_id: str) -> list[pb.GenerateRequest]:
    return [chat_request(body, request_id)]


def check_model(body: _Generate, served: str) -> None:
    """An omitted model means the served one, and so does the path it was served from (`served` is that path's
    display name: validate.display_name); any other name is unknown here."""
    if body.model and body.model != served and display_name(body.model) != served:
        raise model_not_found(body.model)

