"""Generation events -> the Responses API's response object, whole or as its stream of typed events.

One `ResponseWriter` per request follows the choice's events (ChoiceDelta, ChoiceEnd) into output items: text goes
into an assistant message (one output_text part), each tool call becomes a function_call item, and text after a call
opens a new message. Streamed, every change is an event in OpenAI's order: response.created and .in_progress; per
message output_item.added, content_part.added, output_text.delta..., output_text.done, content_part.done,
output_item.done; per call output_item.added, function_call_arguments.delta and .done, output_item.done; then
response.completed, or response.incomplete where max_output_tokens cut the output (a failure after the stream began:
an error event, then response.failed). Each event carries its sequence_number; the SDKs read the type from the data.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable

from tandem.core.logprobs import TokenLogprob
from tandem.gateway.events import ChoiceDelta, ChoiceEnd
from tandem.gateway.openai.convert import served_tier
from tandem.gateway.openai.errors import OpenAIError, from_exception
from tandem.gateway.openai.responses import tandem_extra
from tandem.gateway.openai.schemas import ResponsesRequest
from tandem.gateway.openai.tokens import TokenTexts, chat_logprobs
from tandem.gateway.tools import ToolCall

log = logging.getLogger(__name__)

FAILED_CODES = {400: "invalid_prompt", 429: "rate_limit_exceeded"}


def sse_event(event: dict) -> bytes:
    """One server-sent event as OpenAI streams responses: `event: <type>` and its `data`."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


class ResponseWriter:
    def __init__(self, response_id: str, model: str, texts: TokenTexts, body: ResponsesRequest,
                 logprobs: bool, store: bool = False, background: bool = False) -> None:
        """store: the finished response will be stored (what its `store` field says); background: it runs in the
        background (gateway.openai.background), `queued` until `start`."""
        self.id, self.model, self.texts, self.body, self.logprobs = response_id, model, texts, body, logprobs
        self.store, self.background = store, background
        self.started = not background
        self.cancelled = False
        self.created_at = int(time.time())
        self.output: list[dict] = []
        self.end: ChoiceEnd | None = None
        self.error: dict | None = None
        self._message: dict | None = None  # the message item text is going into, while it is open
        self._held: list[TokenLogprob] = []  # logprobs of tokens whose text has not come out yet
        self._sequence = 0

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def opening(self) -> list[dict]:
        """The first events: response.created, then response.in_progress (response.queued in the background)."""
        created = self._event("response.created", response=self.response())
        return [created, self._event("response.in_progress" if self.started else "response.queued",
                                     response=self.response())]

    def start(self) -> list[dict]:
        """A background response's generation began: response.in_progress."""
        self.started = True
        return [self._event("response.in_progress", response=self.response())]

    def add(self, event: ChoiceDelta | ChoiceEnd) -> list[dict]:
        """The stream's events for one generation event (the whole response keeps the same state)."""
        if isinstance(event, ChoiceEnd):
            self.end = event
            return self._close_message()
        self._held += event.logprobs or []
        events = self._text(event.text) if event.text else []
        if event.tool_calls:  # held tokens were the calls' (a message reports the logprobs of its text)
            self._held = []
        for call in event.tool_calls:
            events += self._close_message() + self._call(call)
        return events

    def closing(self) -> list[dict]:
        """The last events: the open message closed, then the finished response."""
        events = self._close_message()
        status = self.status()
        return events + [self._event(f"response.{status}", response=self.response())]

    def finished(self) -> dict:
        """The whole response, once every event is in (the open message closed)."""
        self.closing()
        return self.response()

    def cancel(self) -> list[dict]:
        """A background response stopped by POST .../cancel: its open message closed, its status cancelled (the
        API has no event for it: the stream just ends)."""
        self.cancelled = True
        return self._close_message()

    def failed(self, error: OpenAIError) -> list[dict]:
        body = error.body()["error"]
        # A failed response's code is one of OpenAI's few (the error event before it keeps the API's own code).
        code = FAILED_CODES.get(error.status, "server_error")
        self.error = {"code": code, "message": body["message"]}
        return [self._event("error", code=body.get("code") or body["type"], message=body["message"],
                            param=body.get("param")),
                self._event("response.failed", response=self.response())]

    def status(self) -> str:
        if self.error is not None:
            return "failed"
        if self.cancelled:
            return "cancelled"
        if self.end is None:
            return "in_progress" if self.started else "queued"
        return "incomplete" if self.end.finish_reason == "length" else "completed"

    # --- items ---

    def _text(self, text: str) -> list[dict]:
        events = []
        if self._message is None:
            self._message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": "in_progress",
                             "role": "assistant", "content": []}
            self.output.append(self._message)
            events += [self._event("response.output_item.added", output_index=len(self.output) - 1,
                                   item=_copy(self._message)),
                       self._event("response.content_part.added", **self._place(), part=_part("", []))]
            self._message["content"].append(_part("", []))
        part = self._message["content"][0]
        entries = chat_logprobs(self.texts, self._held)["content"] if self.logprobs else []
        self._held = []
        part["text"] += text
        part["logprobs"] += entries
        return events + [self._event("response.output_text.delta", **self._place(), delta=text, logprobs=entries)]

    def _close_message(self) -> list[dict]:
        message, self._message = self._message, None
        if message is None:
            return []
        cut = self.cancelled or (self.end is not None and self.end.finish_reason == "length")
        message["status"] = "incomplete" if cut else "completed"
        part, place = message["content"][0], self._place(message)
        return [self._event("response.output_text.done", **place, text=part["text"], logprobs=part["logprobs"]),
                self._event("response.content_part.done", **place, part=_copy(part)),
                self._event("response.output_item.done", output_index=place["output_index"], item=_copy(message))]

    def _place(self, message: dict | None = None) -> dict:
        message = message or self._message
        return {"item_id": message["id"], "output_index": self.output.index(message), "content_index": 0}

    def _call(self, call: ToolCall) -> list[dict]:
        item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "completed", "call_id": call.id,
                "name": call.name, "arguments": call.arguments}
        self.output.append(item)
        index = len(self.output) - 1
        return [self._event("response.output_item.added", output_index=index,
                            item=item | {"status": "in_progress", "arguments": ""}),
                self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                            delta=call.arguments),
                self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            name=call.name, arguments=call.arguments),
                self._event("response.output_item.done", output_index=index, item=_copy(item))]

    # --- the response object ---

    def response(self) -> dict:
        body, end = self.body, self.end
        text_format = (body.text or {}).get("format") or {"type": "text"}
        tools = [{"type": "function", "name": tool.get("name"), "description": tool.get("description"),
                  "parameters": tool.get("parameters"), "strict": tool.get("strict")} for tool in body.tools or ()]
        response = {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": self.status(),
            "background": self.background, "error": self.error, "model": self.model, "output": _copy(self.output),
            "incomplete_details": {"reason": "max_output_tokens"} if self.status() == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "service_tier": served_tier(body), "store": self.store,
            "temperature": body.temperature,
            "text": {"format": text_format}, "tool_choice": body.tool_choice or "auto", "tools": tools,
            "top_p": body.top_p, "top_logprobs": body.top_logprobs, "truncation": body.truncation or "disabled",
            "user": body.user, "metadata": body.metadata or {}, "usage": None}
        if (conversation := body.conversation_id()) is not None:
            response["conversation"] = {"id": conversation}
        if end is not None:
            response["usage"] = {"input_tokens": end.prompt_tokens, "output_tokens": end.completion_tokens,
                                 "total_tokens": end.prompt_tokens + end.completion_tokens,
                                 "input_tokens_details": {"cached_tokens": end.stats["cached_prompt_tokens"],
                                                          "cache_write_tokens": 0},
                                 "output_tokens_details": {"reasoning_tokens": 0}}
            response["tandem"] = tandem_extra(end)
        return response


def output_of(events: list[dict]) -> list[dict]:
    """The output items a response's stream events built, as far as they go (what a replica stores of a response
    whose runner died, from its log); an item left unfinished is incomplete."""
    output: dict[int, dict] = {}
    for event in events:
        kind = event["type"]
        if kind in ("response.output_item.added", "response.output_item.done"):
            output[event["output_index"]] = _copy(event["item"])
        elif kind == "response.content_part.added":
            output[event["output_index"]]["content"].append(_copy(event["part"]))
        elif kind == "response.output_text.delta":
            part = output[event["output_index"]]["content"][event["content_index"]]
            part["text"] += event["delta"]
            part["logprobs"] += _copy(event["logprobs"])
        elif kind == "response.function_call_arguments.delta":
            output[event["output_index"]]["arguments"] += event["delta"]
    items = [output[index] for index in sorted(output)]
    for item in items:
        if item["status"] == "in_progress":
            item["status"] = "incomplete"
    return items


def failed_events(response: dict, sequence: int) -> list[dict]:
    """The last events of a failed response from `sequence` on, as ResponseWriter.failed writes them."""
    error = response["error"]
    return [{"type": "error", "sequence_number": sequence, "code": error["code"], "message": error["message"],
             "param": None},
            {"type": "response.failed", "sequence_number": sequence + 1, "response": response}]


def _part(text: str, logprobs: list[dict]) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _copy(value):
    """A snapshot for an event: later text must not change what an earlier event said."""
    return json.loads(json.dumps(value))


async def response_events(events: AsyncGenerator, writer: ResponseWriter, renames: dict[str, str],
                          keep: Callable[[dict], Awaitable[None]]) -> AsyncGenerator[bytes, None]:
    """The SSE body of a streamed response over the generation's `events`; `keep`: given the finished response before
    its last event goes, so a client that continues it at once finds it (a failed one too: the id its response.failed
    event names can be read back, as OpenAI's can)."""
    async with contextlib.aclosing(events):
        for event in writer.opening():
            yield sse_event(event)
        try:
            async for event in events:
                for out in writer.add(event):
                    yield sse_event(out)
        except Exception as exc:  # after the headers: the failure travels as events
            failure = writer.failed(from_exception(exc, renames))
            await _keep_failed(keep, writer.response())
            for out in failure:
                yield sse_event(out)
            return
        closing = writer.closing()
        await keep(writer.response())
        for out in closing:
            yield sse_event(out)


async def _keep_failed(keep: Callable[[dict], Awaitable[None]], response: dict) -> None:
    """Store a failed response; a store that fails too is logged, so the client still gets the events that say why."""
    try:
        await keep(response)
    except Exception:
        log.exception("response %s: storing the failed response failed", response["id"])
