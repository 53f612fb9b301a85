"""Structured outputs on the HTTP API: OpenAI's `response_format` and vLLM's `structured_outputs`, as the wire's
ResponseFormat.

Only shapes are read here (tandem.response_format, shared with the Python client); whether a schema or expression
compiles is the gateway's validation's to say, with the model's tokenizer, in a message naming response_format:
`renames` points it at structured_outputs when that is the field the body used.
"""

from __future__ import annotations

import re
from typing import Any

from tandem.errors import InvalidArgument
from tandem.gateway.openai.schemas import _Generate
from tandem.response_format import schema_text, structural_tag_text, wire_format
from tandem.v1 import generation_pb2 as pb

STRUCTURED = "structured_outputs"
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# vLLM's per-field names, removed in its 0.12 for structured_outputs' keys.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def response_format(body: _Generate) -> pb.ResponseFormat | None:
    """The format a body asks for; None for free text. response_format {"type": "text"} beside structured_outputs
    is no conflict: it asks for nothing."""
    for name, key in GUIDED.items():
        if getattr(body, name) is not None:
            raise InvalidArgument(f"{name}: not supported by this server; send structured_outputs "
                                  f"{{\"{key}\": ...}} instead, as vLLM now takes it")
    wanted = wire_format(body.response_format)
    if body.structured_outputs is None:
        return wanted
    if wanted is not None:
        raise InvalidArgument(f"{STRUCTURED}: cannot combine with response_format; send one of them")
    return structured_format(body.structured_outputs)


def structured_format(value: dict[str, Any]) -> pb.ResponseFormat:
    """vLLM's structured_outputs: exactly one of {"json": a schema or its JSON text}, {"regex": an expression},
    {"choice": [strings]} (the output is one of them), {"grammar": a Lark or GBNF grammar}, {"json_object": true} or
    {"structural_tag": its JSON text (or object)}: free text with tagged parts (tandem.response_format.structural_tags).
    Keys set to null or false count as unset (clients send vLLM's flags at their defaults); any other key is refused
    by name."""
    given = {key: item for key, item in value.items() if item is not None and item is not False}
    others = sorted(set(given) - set(STRUCTURED_KEYS))
    if others:
        raise InvalidArgument(f"{STRUCTURED}: {others[0]!r} is not supported by this server (it takes one of "
                              f"{', '.join(STRUCTURED_KEYS)})")
    if len(given) != 1:
        raise InvalidArgument(f"{STRUCTURED}: set exactly one of {', '.join(STRUCTURED_KEYS)}, got "
                              f"{', '.join(sorted(given)) or 'none'}")
    (key, item), = given.items()
    if key == "json":
        return pb.ResponseFormat(json_schema=schema_text(item, STRUCTURED, "json"))
    if key == "structural_tag":
        return pb.ResponseFormat(structural_tag=structural_tag_text(item, STRUCTURED))
    if key == "json_object":
        if item is not True:
            raise InvalidArgument(f"{STRUCTURED}: json_object must be true, got {item!r}")
        return pb.ResponseFormat(json_object=True)
    if key in ("regex", "grammar"):
        if not isinstance(item, str) or not item.strip():
            raise InvalidArgument(f"{STRUCTURED}: {key} must be non-empty text")
        return pb.ResponseFormat(**{key: item})
    if not isinstance(item, list) or not item or not all(isinstance(choice, str) for choice in item):
        raise InvalidArgument(f"{STRUCTURED}: choice must be a non-empty list of strings")
    # The choices as literal text: re.escape's escapes are ones llguidance's regular expressions read the same way.
    return pb.ResponseFormat(regex="(?:" + "|".join(re.escape(choice) for choice in item) + ")")


def renames(body: _Generate, base: dict[str, str]) -> dict[str, str]:
    """The endpoint's renames, with the gateway's "response_format: ..." messages naming structured_outputs where
    the body asked through it."""
    return {**base, "response_format": STRUCTURED} if body.structured_outputs is not None else base
