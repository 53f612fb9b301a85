"""Forced tool calls: what a "required" or named tool_choice writes at the end of the prompt, and the output format
that masks the rest of the call, so the model calls an offered tool with arguments its schema accepts.

The call is written as Qwen2.5's chat template writes one (the tags and JSON layout gateway.tools reads back), so the
parser takes the forced call out of the output like any other.
"""

from __future__ import annotations

import json
from typing import Any

from tandem.core.config import OutputFormat
from tandem.core.formats import JSON_OPTIONS
from tandem.gateway.tools import CLOSE, NAMED, OPEN, _json_object
from tandem.v1 import generation_pb2 as pb

AFTER_NAME = ', "arguments": '  # between a call's name (a JSON string) and its arguments, as Qwen2.5's template has it
CALL_START = '\n{"name": '  # between the opening tag and the call's name, as the template has it


def forced_call_start(chat: pb.Chat) -> str:
    """The start of the call a "required" or named tool_choice asks for, or "". The gateway appends it to the
    prompt, after the template's opening of the assistant's turn, so the model writes the rest of the call: of its
    own choosing (required) or with that tool's name already written (named), under call_format."""
    if chat.tool_choice == "required":
        return OPEN + CALL_START + '"'
    if chat.tool_choice.startswith(NAMED):
        return OPEN + CALL_START + json.dumps(chat.tool_choice[len(NAMED) :]) + AFTER_NAME
    return ""


def call_format(chat: pb.Chat, tokenizer: Any) -> OutputFormat:
    """The format of what follows forced_call_start: an offered tool's name (required), then `", "arguments": `, its
    arguments as a JSON object its parameters' schema allows, the call's closing brace, then the closing tag or
    nothing (the output ends there). Masked so, even a model that would have written something else calls a tool,
    and one it was offered, with arguments its schema accepts. A required call may be followed by more, each in tags
    of its own, as OpenAI's "required" allows parallel calls, unless parallel_tool_calls is false (single_tool_call);
    a named tool_choice asks for one call of that tool."""
    close, newline, brace = _tag(tokenizer, CLOSE), _literal("\n"), _literal("}")
    named = chat.tool_choice[len(NAMED) :] if chat.tool_choice.startswith(NAMED) else None
    tools = [tool for tool in chat.tools if named is None or tool.name == named]
    rules = [f"args_{index}: %json {json.dumps(_arguments_schema(tool, index))}" for index, tool in enumerate(tools)]
    end = f"({newline} {close})?"  # the closing tag, or nothing: the output ends after the call's brace
    if named is not None:
        return OutputFormat("lark", "\n".join([f"start: args_0 {brace} {end}", *rules]))
    # The prompt ends inside the name's string: the rest of it is json.dumps(name) past its opening quote.
    first = " | ".join(f"{_literal(json.dumps(tool.name)[1:] + AFTER_NAME)} args_{index} {brace}"
                       for index, tool in enumerate(tools))
    if chat.single_tool_call:
        return OutputFormat("lark", "\n".join([f"start: first {end}", f"first: {first}", *rules]))
    # Each further call as the template writes one: the tags on lines of their own around the call's JSON.
    more = " | ".join(f"{_literal(CALL_START + json.dumps(tool.name) + AFTER_NAME)} args_{index} {brace}"
                      for index, tool in enumerate(tools))
    separator = f"{newline} {close} {newline} {_tag(tokenizer, OPEN)}"
    return OutputFormat("lark", "\n".join([f"start: first ({separator} more)* {end}", f"first: {first}",
                                           f"more: {more}", *rules]))


def _arguments_schema(tool: pb.Tool, index: int) -> dict:
    schema = _json_object(tool.parameters_json or "{}", f"chat.tools[{index}].parameters") or {"type": "object"}
    # Whitespace inside the arguments as in any JSON format (core.formats), unless the schema says otherwise.
    return schema if "x-guidance" in schema else schema | {"x-guidance": JSON_OPTIONS}


def _tag(tokenizer: Any, tag: str) -> str:
    """A call's tag as the grammar names it: a token of its own where the tokenizer has one (Qwen2.5's vocabulary
    does, and llguidance matches such a token only by its id), else its text."""
    token = tokenizer.get_added_vocab().get(tag)
    return f"<[{token}]>" if token is not None else _literal(tag)


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # a Lark string: a JSON string's escapes
