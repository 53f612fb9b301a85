"""Tool calls: a chat's functions offered to the model through its chat template, and the calls it makes read back
out of its output.

Qwen2.5's chat template (and the other Hermes-style ones vLLM's `hermes` parser reads) shows the model the
functions as JSON and asks it to answer a call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. Small
models often write the call's JSON in a Markdown code block instead (Qwen2.5-Coder-1.5B did in every chat measured,
docs/performance.md). Either counts as a call when it calls one of the offered tools. ToolCallParser takes
these blocks out of the text as it streams: text outside them streams on at once, a block that may be a call is held
until it closes (an ordinary code block only until its first line shows it is not one) and then comes out as one
ToolCall, and a block that is not a call comes out as the text it was, so nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection
from dataclasses import dataclass

from tandem.errors import InvalidArgument
from tandem.v1 import generation_pb2 as pb

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FENCE, NAME_KEY = "```", '"name"'  # a Markdown code block whose JSON object starts with the call's name
FINISH_TOOL_CALLS = "tool_calls"  # a choice's finish reason when its output ends in calls (OpenAI's)
# tool_choice: "" or "auto" (the model decides), "none" (no tools shown), "required" (a call of any offered tool), or
# "function:NAME" (a call of that tool).
TOOL_CHOICES = ("", "auto", "none", "required")
NAMED = "function:"


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
    """Splits a choice's streamed text into text and tool calls. `names`: the offered tools', one of which a block
    must call to count as a call."""

    def __init__(self, names: Collection[str] = (), single: bool = False, prompted: str = "") -> None:
        """single: the first call ends the output (parallel_tool_calls false): nothing after it comes out.
        prompted: the start of a call the prompt wrote (gateway.forced_calls): read as the output's start, never
        given out as text (an output cut before its call closes gives out what the model wrote of it alone)."""
        self.names = frozenset(names)
        self.single = single
        # Text not given out yet: a block that may be a call (from its opener on), or an opener's start.
        self._held = prompted
        self._prompted = len(prompted)  # how much of _held's start the model did not write
        # At the output's start or just after a call, with no text but whitespace (_gap) since: that whitespace is
        # the layout of calls, given out only before text that follows it (or at the end of an output with no call).
        self._at_edge = True
        self._gap = ""
        self.called = False  # whether any call came out
        self.ended = False  # single, and its call came out

    def push(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        """The text that can go out now and the calls completed by `text` (runs, joined); `final` gives out
        everything held."""
        runs = self.runs(text, final)
        return "".join(piece for piece, _ in runs), [call for _, calls in runs for call in calls]

    def runs(self, text: str, final: bool = False) -> list[tuple[str, list[ToolCall]]]:
        """What `text` completes, in the order the model wrote it: runs of text, each with the calls that follow it
        (the last run's may be none). Whitespace before the first call or after one goes out only with text that
        follows it: before, between or after calls it is their layout, not text (a chat's content, a response's
        message), as a whole response reads it."""
        if self.ended:
            return []
        held, runs, out = self._held + text, [], []

        def give(piece: str) -> None:
            if self._at_edge:  # held until text that is not whitespace comes
                self._gap += piece
                if not self._gap.strip():
                    return
                piece, self._gap, self._at_edge = self._gap, "", False
            out.append(piece)

        while held:
            start = min((i for i in (held.find(OPEN), held.find(FENCE)) if i >= 0), default=-1)
            if start < 0:
                keep = 0 if final else max(_partial_tag(held, OPEN), _partial_tag(held, FENCE))
                give(held[: len(held) - keep])
                held = held[len(held) - keep :]
                break
            give(held[:start])
            held = held[start:]
            block = self._tagged(held, final) if held.startswith(OPEN) else self._fenced(held, final)
            if block is None:  # undecided until more text comes
                break
            length, call = block
            if call is None:
                give(held[self._prompted : length])  # not a call: what the model wrote goes out as it was
            else:
                self._gap, self._at_edge = "", True
                if out or not runs:
                    runs.append(("".join(out), [call]))
                else:
                    runs[-1][1].append(call)  # calls with nothing but their layout between them
                out, self.called = [], True
                if self.single:
                    self.ended, held = True, ""
                    break
            held, self._prompted = held[length:], 0
        self._held = held
        if final and self._gap and not self.called:  # an output of whitespace alone is its text
            out.append(self._gap)
            self._gap = ""
        if out:
            runs.append(("".join(out), []))
        return [run for run in runs if run[0] or run[1]]

    def _fenced(self, held: str, final: bool) -> tuple[int, ToolCall | None] | None:
        """A Markdown code block at the start of `held`: a call when it holds one of the offered tools' call JSON
        (small models often write calls so, rather than in tags: llama.cpp's Hermes parser reads them too)."""
        state, body = _fence_start(held)
        if state == "no":
            return len(FENCE), None  # an ordinary code block: its fence goes out, and what follows is read on
        if state == "maybe":
            return (len(held), None) if final else None
        end = held.find(FENCE, body)
        if end < 0 and not final:
            return None
        return (len(held) if end < 0 else end + len(FENCE)), self._offered(held[body:] if end < 0 else held[body:end])

    def _tagged(self, held: str, final: bool) -> tuple[int, ToolCall | None] | None:
        """A `<tool_call>` block at the start of `held`: its length and call, or None while it is still open."""
        end = held.find(CLOSE, len(OPEN))
        if end < 0:
            return (len(held), self._offered(held[len(OPEN) :])) if final else None
        return end + len(CLOSE), self._offered(held[len(OPEN) : end])

    def _offered(self, body: str) -> ToolCall | None:
        """The call a block's JSON makes, if it calls one of the offered tools: a call of anything else (a model
        will name tools it was not offered) would fail the client that runs it, so it stays text."""
        call = _call(body)
        return call if call is not None and call.name in self.names else None


def _fence_start(text: str) -> tuple[str, int]:
    """Whether the code block `text` opens (it starts with ```, a language of json or none) begins with a call's
    JSON object: ("yes", where the object begins), ("no", 0), or ("maybe", 0) while too little has come to tell."""
    at = len(FENCE)
    language = text[at : at + 4]
    if len(language) < 4 and "json".startswith(language):
        return "maybe", 0
    at += 4 if language == "json" else 0
    while at < len(text) and text[at] in " \t":
        at += 1
    if at == len(text):
        return "maybe", 0
    if text[at] != "\n":
        return "no", 0
    at += 1
    while at < len(text) and text[at].isspace():
        at += 1
    if at == len(text):
        return "maybe", 0
    if text[at] != "{":
        return "no", 0
    body, at = at, at + 1
    while at < len(text) and text[at].isspace():
        at += 1
    head = text[at : at + len(NAME_KEY)]
    if len(head) < len(NAME_KEY):
        return ("maybe", 0) if NAME_KEY.startswith(head) else ("no", 0)
    return ("yes", body) if head == NAME_KEY else ("no", 0)


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
    except (ValueError, RecursionError):  # a model's text nested past the parser's depth is no call either
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the object as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", value["name"], json.dumps(arguments, ensure_ascii=False))


def offers_tools(chat: pb.Chat) -> bool:
    """Whether the model is shown the chat's tools, and its output read for calls."""
    return bool(chat.tools) and chat.tool_choice != "none"


def template_tools(chat: pb.Chat) -> list[dict] | None:
    """The chat's tools as chat templates take them (OpenAI's shape), or None when none are offered."""
    choice = chat.tool_choice
    if choice not in TOOL_CHOICES and not choice.startswith(NAMED):
        raise InvalidArgument(f"chat.tool_choice: {choice!r} is not one of auto, none, required or function:NAME")
    if (choice == "required" or choice.startswith(NAMED)) and not chat.tools:
        raise InvalidArgument(f"chat.tool_choice: {choice!r} needs tools")
    if choice.startswith(NAMED) and choice[len(NAMED) :] not in {tool.name for tool in chat.tools}:
        raise InvalidArgument(f"chat.tool_choice: {choice[len(NAMED):]!r} is none of the tools' names")
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
    except RecursionError:
        raise InvalidArgument(f"{field}: nests arrays or objects too deeply") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"{field}: must be a JSON object, got {type(value).__name__}")
    return value


