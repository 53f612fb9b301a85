"""The tool-call parser on its own, with no server (tandem.gateway.tools.ToolCallParser): calls read out of text
however it is split, calls written as JSON code blocks, a single-call parser that ends the output at its first call,
runs of text and calls in the order written, a held tag start, and a required or named call begun in the prompt."""

from __future__ import annotations

import json

import pytest

from tandem.gateway.forced_calls import forced_call_start
from tandem.gateway.tools import ToolCall, ToolCallParser
from tandem.v1 import generation_pb2 as pb

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _parse(pieces: list[str], names: tuple[str, ...] = ("get_weather", "get_time")) -> tuple[str, list[ToolCall]]:
    parser = ToolCallParser(names)
    text, calls = [], []
    for index, piece in enumerate(pieces):
        out, made = parser.push(piece, final=index == len(pieces) - 1)
        text.append(out)
        calls += made
    return "".join(text), calls


@pytest.mark.parametrize("split", ["whole", "characters"])
def test_calls_come_out_of_the_text_however_it_is_split(split: str) -> None:
    """Text around calls streams on; a block that is not a call's JSON, or calls a tool not offered, stays text; a
    tag arriving in pieces is held until it is known; a block the output ends inside still counts when it holds a
    whole call."""
    unknown = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    output = ("Let me check." + CALL + "\n<tool_call>not json</tool_call>" + unknown + " and <tool"
              + '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}')
    text, calls = _parse([output] if split == "whole" else list(output) + [""])
    assert text == "Let me check.\n<tool_call>not json</tool_call>" + unknown + " and <tool"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                    ("get_time", {"zone": "UTC"})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


FENCED = '```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Osaka"}\n}\n```'


@pytest.mark.parametrize("split", ["whole", "characters"])
def test_a_code_block_that_calls_an_offered_tool_is_a_call_and_other_code_blocks_are_text(split: str) -> None:
    """Small models write calls as JSON code blocks (Qwen2.5-Coder-1.5B does): such a block calling an offered tool
    is a call; code in another language, JSON that is no call, and a call of a tool not offered stay text."""
    code = "```python\nprint({'name': 1})\n```\n"
    other = '```json\n{"a": 1}\n```\n'
    unknown = '```\n{"name": "rm_rf", "arguments": {}}\n```\n'
    output = "Checking.\n" + code + other + unknown + FENCED + "\nDone ```"
    text, calls = _parse([output] if split == "whole" else list(output) + [""])
    assert text == "Checking.\n" + code + other + unknown + "\nDone ```"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Osaka"})]


def test_ordinary_code_streams_on_once_its_first_line_shows_it_is_no_call() -> None:
    parser = ToolCallParser(["get_weather"])
    assert parser.push("Here:\n```") == ("Here:\n", [])
    assert parser.push("py") == ("```py", [])  # not json, not a newline: an ordinary block
    assert parser.push("thon\nx = 1\n") == ("thon\nx = 1\n", [])
    assert parser.push("```json\n{") == ("", [])  # may still be a call
    assert parser.push('"a": 1}') == ('```json\n{"a": 1}', [])


@pytest.mark.parametrize("split", ["whole", "characters"])
def test_a_single_call_parser_ends_the_output_at_its_first_call(split: str) -> None:
    """parallel_tool_calls false: the text before the first call and the call come out; nothing after it does."""
    output = f"Checking. {CALL} then {CALL.replace('Paris', 'Rome')} and more"
    parser = ToolCallParser(("get_weather",), single=True)
    pieces = [output] if split == "whole" else list(output)
    text, calls = [], []
    for index, piece in enumerate(pieces):
        out, made = parser.push(piece, final=index == len(pieces) - 1)
        text.append(out)
        calls += made
    assert "".join(text) == "Checking. " and [json.loads(call.arguments) for call in calls] == [{"city": "Paris"}]
    assert parser.ended and parser.called


@pytest.mark.parametrize("split", ["whole", "characters"])
def test_runs_keep_text_after_a_call_after_it_and_drop_the_layout_between_calls(split: str) -> None:
    """runs() gives text and calls in the order written: text after a call follows it (a response opens a new
    message for it); whitespace before the first call or after one goes out only before text, so calls written on
    lines of their own leave no text before, between or after them (a whole response's content is null so), and
    an output of whitespace alone is still its text."""
    second = CALL.replace("Paris", "Rome")
    for output, want in ((f"Hello {CALL} bye", [("Hello ", ["Paris"]), (" bye", [])]),
                         (f"{CALL}\n{second}\n", [("", ["Paris", "Rome"])]),
                         (f"\n\n{CALL}\n", [("", ["Paris"])]),
                         (f"\n Hi\n{CALL}", [("\n Hi\n", ["Paris"])]),
                         ("\n \n", [("\n \n", [])]),
                         (f"{CALL}\n\nSo: {second} ok", [("", ["Paris"]), ("\n\nSo: ", ["Rome"]), (" ok", [])])):
        parser = ToolCallParser(("get_weather",))
        pieces = [output] if split == "whole" else list(output)
        runs = [run for index, piece in enumerate(pieces) for run in parser.runs(piece, index == len(pieces) - 1)]
        merged: list[tuple[str, list[str]]] = []
        for text, calls in runs:  # a character at a time, runs come in pieces: join them as one push gives them
            cities = [json.loads(call.arguments)["city"] for call in calls]
            if merged and not text:
                merged[-1][1].extend(cities)
            elif merged and not merged[-1][1]:
                merged[-1] = (merged[-1][0] + text, cities)
            else:
                merged.append((text, cities))
        assert merged == want, output


def test_a_held_tag_start_is_given_out_when_no_tag_follows() -> None:
    parser = ToolCallParser()
    assert parser.push("a <tool") == ("a ", [])
    assert parser.push("box> b") == ("<toolbox> b", [])
    assert parser.push("<tool_call>[1, 2]", final=True) == ("<tool_call>[1, 2]", [])
    assert not parser.called


@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_required_or_named_call_is_begun_in_the_prompt_and_read_from_inside_it(choice: str) -> None:
    """The prompt ends with the call's start; the parser, primed with it, reads the model's continuation as the
    rest of the call; a continuation that is no call's JSON (or one cut by max_tokens) comes out as the text the
    model wrote, without the start the prompt wrote."""
    chat = pb.Chat(tools=[pb.Tool(name="get_weather")],
                   tool_choice="required" if choice == "required" else "function:get_weather")
    start = forced_call_start(chat)
    rest = ('get_weather", "arguments": {"city": "Paris"}}' if choice == "required" else '{"city": "Paris"}}')
    parser = ToolCallParser(["get_weather"], prompted=start)
    text, calls = parser.push(rest + "\n</tool_call>", final=True)
    assert text == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    failed = ToolCallParser(["get_weather"], prompted=start)
    assert failed.push("oops", final=True) == ("oops", [])
    cut = ToolCallParser(["get_weather"], prompted=start)
    end = len(rest) - len('ris"}}')  # max_tokens reached inside the city's name
    assert cut.push(rest[: end - 3]) == ("", []) and cut.push(rest[end - 3 : end], final=True) == (rest[:end], [])
    after = ToolCallParser(["get_weather"], prompted=start)  # a call, then a block that is none: all of it out
    assert after.push(rest + "\n</tool_call>\n<tool_call>\nno", final=True)[0] == "\n<tool_call>\nno"
