"""A Responses API body (POST /v1/responses) as the chat completion it asks for.

The Responses API carries a conversation as `input`: a string (one user turn) or items (messages; the function calls
an earlier turn made; their outputs), with `instructions` as its system turn. Its tools are flat (`{"type":
"function", "name", "parameters"}`), a named tool_choice is `{"type": "function", "name"}`, and the output format
sits in `text.format`. Each maps one to one onto a chat completion's field, so the body becomes a
ChatCompletionRequest and takes the chat path from there: the same validation, chat template and tool-call parsing.
A chat's messages do not line up with the input's items (instructions come first; an assistant turn's function
calls are one message), so `renames` names each message by the item it came from in the gateway's messages.

Each input item is also kept in the API's own item shape (an id, one text part; `input_items`), so that a stored
response (gateway.openai.stored) can be continued: `previous_response_id` puts that response's conversation and
output before the new input.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from tandem.gateway.openai.bodies import check_metadata
from tandem.gateway.openai.convert import CHAT_RENAMES
from tandem.gateway.openai.errors import bad_request, validation_error
from tandem.gateway.openai.schemas import ChatCompletionRequest, ResponsesRequest, _Generate

OUTPUT_LOGPROBS = "message.output_text.logprobs"  # the one `include` entry with a meaning here
ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")
HISTORY = "previous_response_id"  # where the messages of a continued response came from
RENAMES = {**CHAT_RENAMES, "chat.messages": "input", "chat": "input", "input": "input",
           "max_tokens": "max_output_tokens", "response_format": "text.format"}


@dataclass(slots=True, frozen=True)
class ResponsesTurn:
    chat: ChatCompletionRequest  # what the body asks for, as a chat completion
    renames: dict[str, str]  # the gateway's names for its messages -> the body's fields
    items: list[dict]  # the conversation the response answers (earlier turns', then this input), as stored
    added: int = 0  # how many of the items, the last ones, are this request's input
    # The stored response whose conversation and output the items begin with, where one is known (previous_response_id,
    # or the response that last extended the conversation): the store keeps only what this one adds to it.
    after: str | None = None

    @property
    def inputs(self) -> list[dict]:
        """This request's own input items (what a conversation gains before the response's output)."""
        return self.items[len(self.items) - self.added:]


def chat_body(body: ResponsesRequest, history: list[dict] | None = None) -> ResponsesTurn:
    """The chat completion `body` asks for; history: the items of the response it continues (previous_response_id),
    its conversation and output."""
    for name in body.unsupported():
        raise bad_request(f"{name}: not supported by this server", name)
    check_metadata(body.metadata)  # OpenAI's limits, as for conversations and batches
    for index, entry in enumerate(body.include or ()):
        if entry != OUTPUT_LOGPROBS:
            raise bad_request(f"include[{index}]: only {OUTPUT_LOGPROBS!r} is supported, got {entry!r}",
                              f"include[{index}]")
    history = history or []
    items = input_items(body.input)
    check_unique_ids(history + items, "input")
    messages, origins = _messages(body.instructions, [(item, HISTORY) for item in history]
                                  + [(item, f"input[{index}]") for index, item in enumerate(items)])
    logprobs = OUTPUT_LOGPROBS in (body.include or ())
    chat = body.model_dump(include=set(_Generate.model_fields)) | {
        "messages": messages, "max_completion_tokens": body.max_output_tokens, "logprobs": logprobs,
        "top_logprobs": (body.top_logprobs or 0) if logprobs else None,
        "tools": [_tool(index, tool) for index, tool in enumerate(body.tools or ())] or None,
        "tool_choice": _tool_choice(body.tool_choice), "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _format(body.text)}
    try:
        chat_request = ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:  # a tool's description or parameters of the wrong type
        raise validation_error(exc.errors()) from exc
    return ResponsesTurn(chat_request, RENAMES | origins, history + items, len(items))


def check_unique_ids(items: list[dict], field: str) -> None:
    """A 400 where two items share an id (a client's own ids are kept): listing a page `after` one could not end."""
    seen: set[str] = set()
    for item in items:
        if item["id"] in seen:
            raise bad_request(f"Duplicate item found with id {item['id']}.", field)
        seen.add(item["id"])


def input_items(value: str | list[dict[str, Any]] | None, field: str = "input") -> list[dict]:
    """`input` (or a conversation's `items`: `field`) as items in the API's shape (what input_items lists), each
    checked: a 400 names the one it cannot take. A string is one user message; None (a count of a stored conversation
    alone) none."""
    if value is None:
        return []
    if isinstance(value, str):
        return [_item({"role": "user", "content": value}, field)]
    return [_item(item, f"{field}[{index}]") for index, item in enumerate(value)]


def _item(item: dict, where: str) -> dict:
    kind = item.get("type", "message")
    given = item.get("id")
    if kind == "message":
        role = item.get("role")
        if role not in ROLES:
            raise bad_request(f"{where}.role: must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
        text = _text(item.get("content"), f"{where}.content")
        part = {"type": "output_text", "text": text, "annotations": []} if role == "assistant" \
            else {"type": "input_text", "text": text}
        return {"id": _id(given, "msg"), "type": "message", "role": role, "status": "completed", "content": [part]}
    if kind == "function_call":
        return {"id": _id(given, "fc"), "type": "function_call", "status": "completed",
                "call_id": _string(item, "call_id", where), "name": _string(item, "name", where),
                "arguments": _string(item, "arguments", where)}
    if kind == "function_call_output":
        return {"id": _id(given, "fco"), "type": "function_call_output", "status": "completed",
                "call_id": _string(item, "call_id", where), "output": _text(item.get("output"), f"{where}.output")}
    raise bad_request(f"{where}.type: only message, function_call and function_call_output items are supported, "
                      f"got {kind!r}", f"{where}.type")


def _id(given: Any, prefix: str) -> str:
    return given if isinstance(given, str) and given else f"{prefix}_{uuid.uuid4().hex}"


def _messages(instructions: str | None, items: list[tuple[dict, str]]) -> tuple[list[dict], dict[str, str]]:
    """The chat's messages from checked items, and for each the field (or instructions) it came from."""
    messages: list[dict] = []
    origins: dict[str, str] = {}

    def add(message: dict, origin: str) -> None:
        origins[f"chat.messages[{len(messages)}]"] = origin
        messages.append(message)

    if instructions:
        add({"role": "system", "content": instructions}, "instructions")
    for item, where in items:
        kind = item["type"]
        if kind == "message":
            add({"role": item["role"], "content": _text(item["content"], f"{where}.content")}, where)
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":  # calls after the turn's text join that turn
                add(last := {"role": "assistant", "content": "", "tool_calls": []}, where)
            last.setdefault("tool_calls", [])
            origins[f"chat.messages[{len(messages) - 1}].tool_calls[{len(last['tool_calls'])}]"] = where
            last["tool_calls"].append(call)
        else:  # function_call_output
            add({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}, where)
    return messages, origins


def _text(content: Any, where: str) -> str:
    """A message's text: a string, or its text parts joined by newlines (as the chat API joins them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}: must be a string or a list of text parts", where)
    texts = []
    for index, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"{where}[{index}]: only text parts are supported, got {kind!r}", f"{where}[{index}]")
        texts.append(part["text"])
    return "\n".join(texts)


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key}: must be a string, got {type(value).__name__}", f"{where}.{key}")
    return value


def _tool(index: int, tool: dict) -> dict:
    """A flat function tool as the chat API's {"type": "function", "function": {...}}."""
    if tool.get("type") != "function":
        raise bad_request(f"tools[{index}].type: only function tools are supported, got {tool.get('type')!r}",
                          f"tools[{index}].type")
    _string(tool, "name", f"tools[{index}]")
    return {"type": "function", "function": {key: tool.get(key) for key in ("name", "description", "parameters")}}


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice  # the chat path refuses the forms it does not take, naming tool_choice


def _format(text: dict | None) -> dict | None:
    """text.format as the chat API's response_format (a schema moves under "json_schema")."""
    found = (text or {}).get("format")
    if not isinstance(found, dict) or found.get("type") != "json_schema":
        return found
    return {"type": "json_schema", "json_schema": {key: found.get(key) for key in ("name", "schema", "strict",
                                                                                    "description")}}
