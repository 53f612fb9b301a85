"""Generation events -> OpenAI response bodies: chat.completion(.chunk) and text_completion, streamed or whole.

One `Responder` per HTTP request turns the gateway's events (ChoiceDelta, ChoiceEnd) into chunks as they come, or
collects them into one response. Usage sums completion tokens over the choices (each prompt counts once). Each
choice's speculation statistics ride along under "tandem", next to its engine request id.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from typing import Literal

from tandem.core.logprobs import TokenLogprob
from tandem.gateway.events import ChoiceDelta, ChoiceEnd
from tandem.gateway.openai.tokens import CompletionLogprobs, TokenTexts, chat_logprobs, vllm_prompt_logprobs
from tandem.gateway.tools import ToolCall

Kind = Literal["chat", "completion"]


def sse(data: dict | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


SSE_DONE = sse("[DONE]")


def tandem_extra(end: ChoiceEnd) -> dict:
    return {"request_id": end.request_id, "speculation": end.stats}


@dataclass(slots=True)
class _Choice:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    end: ChoiceEnd | None = None
    prompt: ChoiceDelta | None = None  # the delta that carried the prompt (echo)


class Responder:
    def __init__(self, kind: Kind, response_id: str, model: str, texts: TokenTexts, n: int,
                 logprobs: bool = False, include_usage: bool = False, token_ids: bool = False,
                 per_prompt: int | None = None, echo: bool = False, top_logprobs: int = 0,
                 prompt_logprobs: int | None = None, service_tier: str = "default", scores_only: bool = False) -> None:
        """n: choices in all; per_prompt: how many of them each prompt has (a batch of prompts), n when None;
        echo: each completion choice begins with its prompt (and its logprobs, with top_logprobs alternatives, when
        they are asked for); prompt_logprobs: vLLM's field of that name, with this many alternatives (whole
        responses: a completion's choices carry it, a chat's response); service_tier: the tier it ran in, which a
        chat's chunks and response report; scores_only: a completion of max_tokens 0 with echo, whose one generated
        token (its prompt's forward gives one anyway) is left out: the prompt alone, its logprobs, no completion
        tokens (gateway.openai.convert.scores_only)."""
        self.kind, self.id, self.model, self.texts = kind, response_id, model, texts
        self.service_tier = service_tier
        self.echo = echo and kind == "completion"
        self.scores_only = scores_only and self.echo
        self.top_logprobs, self.prompt_logprobs = top_logprobs, prompt_logprobs
        self.per_prompt = per_prompt or n
        self.logprobs, self.include_usage, self.token_ids = logprobs, include_usage, token_ids
        self.created = int(time.time())
        self.choices = [_Choice() for _ in range(n)]
        # text_offset counts on across a choice's chunks
        self._completion_logprobs = [CompletionLogprobs(texts) for _ in range(n)] if kind == "completion" else []

    # --- usage ---

    def usage(self) -> dict:
        ends = [choice.end for choice in self.choices if choice.end is not None]
        # Each prompt counts once, however many choices it has; its cached tokens are what it had cached before the
        # request (the fewest of its choices': one computes the prompt, the others copy it from that one).
        prompts: dict[int, tuple[int, int]] = {}
        for end in ends:
            cached = end.stats["cached_prompt_tokens"]
            tokens, fewest = prompts.get(end.index // self.per_prompt, (end.prompt_tokens, cached))
            prompts[end.index // self.per_prompt] = (tokens, min(fewest, cached))
        prompt = sum(tokens for tokens, _ in prompts.values())
        completion = 0 if self.scores_only else sum(end.completion_tokens for end in ends)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                 "prompt_tokens_details": {"cached_tokens": sum(cached for _, cached in prompts.values())}}
        # OpenAI's usage: what of a prediction the output took (core.prediction); completions take one here too.
        usage["completion_tokens_details"] = {
            "reasoning_tokens": 0, "audio_tokens": 0,
            **{name: sum(end.stats[name] for end in ends)
               for name in ("accepted_prediction_tokens", "rejected_prediction_tokens")}}
        return usage

    # --- streaming ---

    def _chunk(self, choices: list[dict]) -> dict:
        chunk = {"id": self.id, "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
                 "created": self.created, "model": self.model, **self._tier(), "choices": choices}
        if self.include_usage:
            chunk["usage"] = None  # OpenAI's shape: null on every chunk but the last
        return chunk

    def _tier(self) -> dict:
        """OpenAI's chat objects say the service tier a request ran in; its completion objects have no such field."""
        return {"service_tier": self.service_tier} if self.kind == "chat" else {}

    def first_chunks(self) -> list[dict]:
        """Chat streams open each choice with the assistant role, before any text."""
        if self.kind != "chat":
            return []
        return [self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]) for index in range(len(self.choices))]

    def chunk(self, event: ChoiceDelta | ChoiceEnd) -> dict | None:
        """The chunk that streams `event`; None where it has nothing to say (text a tool-call parser holds back while
        it reads a call, with no logprobs or ids asked for): OpenAI sends no such chunks, and a client adding up the
        deltas would read an empty content beside the calls where the whole response says null."""
        event = self._scored(event)
        if isinstance(event, ChoiceEnd):
            self.choices[event.index].end = event
            body = {"delta": {}} if self.kind == "chat" else {"text": ""}
            return self._chunk([{"index": event.index, **body, "logprobs": None,
                                 "finish_reason": event.finish_reason, "tandem": tandem_extra(event)}])
        if not (event.text or event.tool_calls or self.token_ids or (self.logprobs and event.logprobs)
                or (self.echo and event.prompt_token_ids is not None)):
            return None
        echoed, prompt_logprobs = self._echo(event)
        body = {"delta": {"content": event.text}} if self.kind == "chat" else {"text": echoed + event.text}
        if event.tool_calls:  # only a chat offers tools
            calls = self.choices[event.index].calls
            body["delta"]["tool_calls"] = [call.to_openai(len(calls) + i) for i, call in enumerate(event.tool_calls)]
            calls.extend(event.tool_calls)
        if self.token_ids:
            body["token_ids"] = event.token_ids
        logprobs = _joined(prompt_logprobs, self._logprobs(event.index, event.logprobs))
        return self._chunk([{"index": event.index, **body, "logprobs": logprobs, "finish_reason": None}])

    def usage_chunk(self) -> dict:
        return self._chunk([]) | {"usage": self.usage()}

    def _scored(self, event: ChoiceDelta | ChoiceEnd) -> ChoiceDelta | ChoiceEnd:
        """The event as a scores-only request answers it: no generated text, ids or logprobs."""
        if not self.scores_only or isinstance(event, ChoiceEnd):
            return event
        return replace(event, text="", token_ids=[], logprobs=[] if event.logprobs is not None else None,
                       tool_calls=())

    def _echo(self, event: ChoiceDelta) -> tuple[str, dict | None]:
        """The prompt's text and logprobs where `event` carries the prompt of an echoing choice; else "", None."""
        if not self.echo or event.prompt_token_ids is None:
            return "", None
        # The prompt as sent, special tokens included (a chat template's markers typed into a prompt): a client that
        # cuts the prompt off the echoed text by its length gets the completion.
        text = self.texts.tokenizer.decode(event.prompt_token_ids, skip_special_tokens=False)
        if not self.logprobs:
            return text, None
        return text, self._completion_logprobs[event.index].format_prompt(
            event.prompt_token_ids[0], _top(event.prompt_logprobs or [], self.top_logprobs))

    def _logprobs(self, index: int, logprobs: list[TokenLogprob] | None) -> dict | None:
        if not self.logprobs or logprobs is None:
            return None
        if self.kind == "chat":
            return chat_logprobs(self.texts, logprobs)
        return self._completion_logprobs[index].format(logprobs)

    # --- whole responses ---

    def collect(self, event: ChoiceDelta | ChoiceEnd) -> None:
        event = self._scored(event)
        choice = self.choices[event.index]
        if isinstance(event, ChoiceEnd):
            choice.end = event
            return
        if event.prompt_token_ids is not None:
            choice.prompt = event
        choice.text.append(event.text)
        choice.token_ids.extend(event.token_ids)
        choice.calls.extend(event.tool_calls)
        if event.logprobs:
            choice.logprobs.extend(event.logprobs)

    def response(self) -> dict:
        choices = []
        for index, choice in enumerate(self.choices):
            echoed, prompt_logprobs = self._echo(choice.prompt) if choice.prompt is not None else ("", None)
            text = echoed + "".join(choice.text)
            body = {"message": {"role": "assistant", "content": text}} if self.kind == "chat" else {"text": text}
            if choice.calls:  # OpenAI's shape: no content beside the calls unless the model wrote some
                body["message"] |= {"content": text if text.strip() else None,
                                    "tool_calls": [call.to_openai() for call in choice.calls]}
            if self.token_ids:
                body["token_ids"] = choice.token_ids
            end = choice.end
            logprobs = _joined(prompt_logprobs, self._logprobs(index, choice.logprobs))
            choices.append({"index": index, **body, "logprobs": logprobs,
                            "finish_reason": end.finish_reason if end else None,
                            "tandem": tandem_extra(end) if end else None}
                           | ({"prompt_logprobs": self._vllm_prompt_logprobs(choice)} if self.kind == "completion"
                              and self.prompt_logprobs is not None else {}))
        response = {"id": self.id, "object": "chat.completion" if self.kind == "chat" else "text_completion",
                    "created": self.created, "model": self.model, **self._tier(), "choices": choices,
                    "usage": self.usage()}
        if self.kind == "chat" and self.prompt_logprobs is not None:  # vLLM's place for a chat's (one prompt)
            response["prompt_logprobs"] = self._vllm_prompt_logprobs(self.choices[0])
        return response

    def _vllm_prompt_logprobs(self, choice: _Choice) -> list[dict | None] | None:
        if choice.prompt is None or choice.prompt.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(self.texts, _top(choice.prompt.prompt_logprobs, self.prompt_logprobs or 0))


def _joined(first: dict | None, second: dict | None) -> dict | None:
    """Completion logprobs of an echoed prompt, then of the tokens after it."""
    if first is None or second is None:
        return first or second
    return {key: first[key] + second[key] for key in first}


def _top(logprobs: list[TokenLogprob] | None, top: int) -> list[TokenLogprob] | None:
    """Each entry with its first `top` alternatives: the engine scored as many as the larger of echo's logprobs and
    prompt_logprobs asked."""
    return None if logprobs is None else [replace(lp, top=lp.top[:top]) for lp in logprobs]
