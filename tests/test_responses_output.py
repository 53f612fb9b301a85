"""The Responses API's stream events and the output they build: a replica that ends a response whose runner died
stores the output its log holds (gateway.openai.responses_output.output_of), which must be what the runner's own
response object said at that point."""

from __future__ import annotations

from tandem.core.stats import RequestStats
from tandem.gateway.events import ChoiceDelta, ChoiceEnd
from tandem.gateway.openai.responses_output import ResponseWriter, output_of
from tandem.gateway.openai.schemas import ResponsesRequest
from tandem.gateway.tools import ToolCall


def _writer() -> ResponseWriter:
    return ResponseWriter("resp_1", "tiny", texts=None, body=ResponsesRequest(model="tiny", input="hi"),
                          logprobs=False)


def _deltas() -> list[ChoiceDelta | ChoiceEnd]:
    call = ToolCall("call_1", "add", '{"a": 1}')
    return [ChoiceDelta(0, "Hello", [1]), ChoiceDelta(0, ", world", [2]), ChoiceDelta(0, "", [3], tool_calls=(call,)),
            ChoiceDelta(0, "after", [4]), ChoiceDelta(0, " the call", [5])]


def test_the_events_of_a_finished_response_build_its_output() -> None:
    writer = _writer()
    events = writer.opening()
    for delta in _deltas():
        events += writer.add(delta)
    events += writer.add(ChoiceEnd(0, "stop", 3, 5, RequestStats().report(False, 0), "req"))
    events += writer.closing()
    output = writer.response()["output"]
    assert [item["type"] for item in output] == ["message", "function_call", "message"]
    assert output_of(events) == output


def test_the_events_of_a_response_cut_short_build_its_output_so_far_and_left_unfinished() -> None:
    writer = _writer()
    events = writer.opening()
    for delta in _deltas():
        events += writer.add(delta)
    output = output_of(events)
    assert output[:2] == writer.response()["output"][:2]  # finished items as they were
    assert output[2]["content"][0]["text"] == "after the call" and output[2]["status"] == "incomplete"
    assert output_of(writer.opening()) == []
