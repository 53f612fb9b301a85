"""Tool calls: a chat's functions offered to the model through its chat template, and the calls it makes read back
out of its output.

Qwen2.5's chat template (and the other Hermes-style ones vLLM's `hermes` parser reads) shows the model the
functions as JSON and asks it to answer a call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
ToolCallParser takes such blocks out of the text as it streams: text outside them streams on at once, a block is
held until it closes and then comes out as one ToolCall, and a block that is not a call's JSON comes out as the text
it was, so nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from tandem.errors import InvalidArgument
from tandem.v1 import generation_pb2 as pb

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FINISH_TOOL_CALLS = "tool_calls"  # a choice's finish reason when its output ends in calls (OpenAI's)
TOOL_CHOICES = ("", "auto", "none")  # "required" and a named function would need constrained decoding


@dataclass(slots=True, frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, in JSON text

    def to_pb(self) -> pb.ToolCall:
        return pb.ToolCall(id=self.id, name=self.name, arguments_json=self.arguments)

    def to_openai(self, index: int | None = None) -> dict:
        """OpenAI's shape: a message's call, or a streamed delta's (which carries its place among the calls)."""
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


class ToolCallParser:
    """Splits a choice's streamed text into text and tool calls."""

    def __init__(self) -> None:
        self._held = ""  # text not given out yet: a block still open, or what may be the start of OPEN
        self._inside = False
        self.called = False  # whether any call came out

    def push(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        """The text that can go out now and the calls completed by `text`; `final` gives out everything held."""
        held, out, calls = self._held + text, [], []
        while True:
            if not self._inside:
                start = held.find(OPEN)
                if start < 0:
                    keep = 0 if final else _partial_tag(held, OPEN)
                    out.append(held[: len(held) - keep])
                    held = held[len(held) - keep :]
                    break
                out.append(held[:start])
                held, self._inside = held[start + len(OPEN) :], True
            end = held.find(CLOSE)
            if end < 0 and not final:
                break
            body = held if end < 0 else held[:end]
            call = _call(body)
            if call is None:
                out.append(OPEN + body + ("" if end < 0 else CLOSE))
            else:
                calls.append(call)
            held, self._inside = ("" if end < 0 else held[end + len(CLOSE) :]), False
            if end < 0:
                break
        self._held = held
        self.called = self.called or bool(calls)
        return "".join(out), calls


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`: held back, as the tag may be arriving."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


def _call(body: str) -> ToolCall | None:
    """A block's call, or None when it is not `{"name": str, "arguments": object}` JSON."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the object as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", value["name"], json.dumps(arguments, ensure_ascii=False))


def offers_tools(chat: pb.Chat) -> bool:
    """Whether the model is shown the chat's tools, and its output read for calls."""
    return bool(chat.tools) and chat.tool_choice != "none"


def template_tools(chat: pb.Chat) -> list[dict] | None:
    """The chat's tools as chat templates take them (OpenAI's shape), or None when none are offered."""
    if chat.tool_choice not in TOOL_CHOICES:
        raise InvalidArgument(f"chat.tool_choice: {chat.tool_choice!r} is not supported (one of auto, none)")
    if not offers_tools(chat):
        return None
    tools = []
    for index, tool in enumerate(chat.tools):
        if not tool.name:
            raise InvalidArgument(f"chat.tools[{index}].name: must not be empty")
        parameters = _json_object(tool.parameters_json or "{}", f"chat.tools[{index}].parameters")
        function = {"name": tool.name, "description": tool.description} if tool.description else {"name": tool.name}
        tools.append({"type": "function", "function": function | {"parameters": parameters}})  # OpenAI's key order
    return tools


def template_message(index: int, message: pb.ChatMessage) -> dict:
    """One chat message as chat templates take it: its calls' arguments as objects, a tool turn's id and name."""
    turn: dict = {"role": message.role, "content": message.content}
    if message.tool_calls:
        turn["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": _json_object(
                 call.arguments_json or "{}", f"chat.messages[{index}].tool_calls[{n}].arguments")}}
            for n, call in enumerate(message.tool_calls)]
    if message.tool_call_id:
        turn["tool_call_id"] = message.tool_call_id
    if message.name:
        turn["name"] = message.name
    return turn


def _json_object(text: str, field: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise InvalidArgument(f"{field}: must be a JSON object ({exc})") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"{field}: must be a JSON object, got {type(value).__name__}")
    return value


