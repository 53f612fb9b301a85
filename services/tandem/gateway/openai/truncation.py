"""The Responses API's `truncation: "auto"`: a conversation too long for the model loses its oldest turns, as few as
let its prompt fit, rather than the request failing.

A turn starts at a user message, so what is dropped is whole exchanges: never a function call without its output, nor
an output without its call. The instructions always stay, and so does the last turn (the new input); where even that
does not fit, the request fails as it would without truncation. The prompt must fit both the server's
max_prompt_tokens and the model's context window less the tokens asked for. Each candidate is counted with the
template applied (the gateway's tokenize path); the fewest turns to drop is found by bisection, since a shorter
conversation never has more tokens.
"""

from __future__ import annotations

import math
from dataclasses import replace

from tandem.errors import InvalidArgument
from tandem.gateway.generation import Generations
from tandem.gateway.openai.convert import chat_request
from tandem.gateway.openai.responses_input import ResponsesTurn, chat_body
from tandem.gateway.openai.schemas import ResponsesRequest


def prompt_budget(generations: Generations, max_output_tokens: int | None) -> int:
    """The most prompt tokens a request asking for `max_output_tokens` may have."""
    budget = generations.limits.max_prompt_tokens
    if (window := generations.model_limits.context_window) is not None:
        budget = min(budget, window - (max_output_tokens or generations.limits.default_max_tokens))
    return budget


async def count(generations: Generations, turn: ResponsesTurn, tenant: str) -> float:
    """The prompt tokens of `turn`; infinite where it is past what the gateway tokenizes at all (more messages or
    bytes than a request may have): a conversation grown past those fits once its oldest turns are dropped too."""
    try:
        return len(await generations.tokenize(chat=chat_request(turn.chat, "count").chat, tenant=tenant))
    except InvalidArgument:  # (a suffix refused for another reason fails as the request, with its own message)
        return math.inf


def turn_starts(items: list[dict]) -> list[int]:
    """Where each turn after the first begins: the index of every user message but the first item."""
    return [index for index, item in enumerate(items)
            if index > 0 and item.get("type", "message") == "message" and item.get("role") == "user"]


async def fitted(body: ResponsesRequest, history: list[dict], generations: Generations, tenant: str
                 ) -> tuple[ResponsesTurn, int]:
    """The turn `body` asks for, its oldest turns dropped until the prompt fits; and how many items were dropped."""
    whole = chat_body(body, history)
    budget = prompt_budget(generations, body.max_output_tokens)
    if await count(generations, whole, tenant) <= budget:
        return whole, 0
    starts = turn_starts(whole.items)
    if not starts:
        return whole, 0  # one turn: nothing to drop (the request fails on its length as it would have)
    bare = body.model_copy(update={"input": None})

    def without(start: int) -> ResponsesTurn:
        return replace(chat_body(bare, whole.items[start:]), added=whole.added)

    low, high = 0, len(starts) - 1  # find the first start whose suffix fits; the last is the fewest tokens
    while low < high:
        middle = (low + high) // 2
        if await count(generations, without(starts[middle]), tenant) <= budget:
            high = middle
        else:
            low = middle + 1
    return without(starts[low]), starts[low]
