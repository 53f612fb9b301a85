"""OpenAI's response_format shapes as the wire's ResponseFormat (protos/tandem/v1/generation.proto).

The Python client and the OpenAI-compatible HTTP API take the same shapes and refuse the same mistakes, each message
starting with the field it names ("response_format: ..."). Whether a schema or an expression compiles is the
gateway's to say (tandem.gateway.validate), with the model's tokenizer. Imports only the generated protobuf code and
the standard library: the client install (grpcio, protobuf) has everything this needs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tandem.errors import InvalidArgument
from tandem.v1 import generation_pb2 as pb

FIELD = "response_format"
# regex and grammar: tandem's, beside OpenAI's; structural_tag: vLLM's
TYPES = ("text", "json_object", "json_schema", "regex", "grammar", "structural_tag")


def wire_format(value: Mapping[str, Any] | None, field: str = FIELD) -> pb.ResponseFormat | None:
    """The ResponseFormat a response_format mapping asks for; None for free text. The shapes:

        {"type": "text"}                                          free text (as None)
        {"type": "json_object"}                                   any JSON object
        {"type": "json_schema", "json_schema": {"name": "...", "schema": {...}, "strict": true, "description": ""}}
        {"type": "regex", "regex": "..."}                         text the expression matches whole
        {"type": "grammar", "grammar": "..."}                     text the grammar (Lark or GBNF) matches whole
        {"type": "structural_tag", "structures": [{"begin": "<f=x>", "schema": {...}, "end": "</f>"}],
         "triggers": ["<f="]}                                      free text; from a trigger on, a structure

    A schema may be a mapping or its JSON text; "name", "strict" and "description" are checked for type only (every
    schema is followed strictly)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise InvalidArgument(f"{field}: must be an object with a \"type\", got {type(value).__name__}")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return pb.ResponseFormat(json_object=True)
    if kind == "json_schema":
        return pb.ResponseFormat(json_schema=_json_schema(value.get("json_schema"), field))
    if kind == "regex":
        regex = value.get("regex")
        if not isinstance(regex, str) or not regex:
            raise InvalidArgument(f"{field}: a regex format needs \"regex\", a non-empty expression")
        return pb.ResponseFormat(regex=regex)
    if kind == "grammar":
        grammar = value.get("grammar")
        if not isinstance(grammar, str) or not grammar.strip():
            raise InvalidArgument(f"{field}: a grammar format needs \"grammar\", a non-empty Lark or GBNF grammar")
        return pb.ResponseFormat(grammar=grammar)
    if kind == "structural_tag":
        return pb.ResponseFormat(structural_tag=structural_tag_text(value, field))
    raise InvalidArgument(f"{field}: \"type\" must be one of {', '.join(TYPES)}, got {kind!r}")


def _json_schema(spec: Any, field: str) -> str:
    if not isinstance(spec, Mapping):
        raise InvalidArgument(f"{field}: a json_schema format needs \"json_schema\", an object holding the schema "
                              "under \"schema\"")
    for key, kind in (("name", str), ("description", str), ("strict", bool)):
        if spec.get(key) is not None and not isinstance(spec[key], kind):
            raise InvalidArgument(f"{field}: json_schema.{key} must be a {kind.__name__}, got "
                                  f"{type(spec[key]).__name__}")
    if spec.get("schema") is None:
        raise InvalidArgument(f"{field}: json_schema.schema is required (the JSON schema the output follows)")
    return schema_text(spec["schema"], field, "json_schema.schema")


def schema_text(schema: Any, field: str, where: str) -> str:
    """A JSON schema given as a mapping or as JSON text, as JSON text; it must be a JSON object."""
    if isinstance(schema, str):
        parsed = _loads(schema, field, where)
        if not isinstance(parsed, dict):
            raise InvalidArgument(f"{field}: {where} must be a JSON object, got {type(parsed).__name__}")
        return schema
    if isinstance(schema, Mapping):
        try:
            return json.dumps(dict(schema))
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"{field}: {where} is not JSON: {exc}") from None
    raise InvalidArgument(f"{field}: {where} must be a JSON object (or its JSON text), got {type(schema).__name__}")


def _loads(text: str, field: str, where: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InvalidArgument(f"{field}: {where} is not JSON: {exc}") from None


def structural_tag_text(value: Any, field: str = FIELD) -> str:
    """vLLM's structural_tag, as an object or its JSON text, checked (structural_tags) and as JSON text."""
    tags = structural_tags(value, field)
    return json.dumps({"structures": [{"begin": begin, "schema": schema, "end": end} for _, begin, schema, end in tags],
                       "triggers": sorted({trigger for trigger, *_ in tags})})


def structural_tags(value: Any, field: str = FIELD) -> list[tuple[str, str, dict, str]]:
    """(trigger, begin, schema, end) per structure of a structural_tag: {"structures": [{"begin", "schema", "end"}],
    "triggers": [...]} (a "type" key beside them is ignored). The output is free text until it writes a trigger;
    from there it must go on to one of the structures that begin with that trigger, its JSON (schema) and its end,
    then free text again. Each begin must start with one of the triggers, the longest of which is its trigger."""
    if isinstance(value, str):
        value = _loads(value, field, "the structural_tag")
    if not isinstance(value, Mapping):
        raise InvalidArgument(f"{field}: a structural_tag is an object with \"structures\" and \"triggers\"")
    structures, triggers = value.get("structures"), value.get("triggers")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise InvalidArgument(f"{field}: structural_tag.triggers must be a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise InvalidArgument(f"{field}: structural_tag.structures must be a non-empty list")
    tags = []
    for index, structure in enumerate(structures):
        where = f"structural_tag.structures[{index}]"
        if not isinstance(structure, Mapping):
            raise InvalidArgument(f"{field}: {where} must be an object with \"begin\", \"schema\" and \"end\"")
        begin, end = structure.get("begin"), structure.get("end")
        if not isinstance(begin, str) or not isinstance(end, str):
            raise InvalidArgument(f"{field}: {where}.begin and .end must be strings")
        opened = [trigger for trigger in triggers if begin.startswith(trigger)]
        if not opened:
            raise InvalidArgument(f"{field}: {where}.begin {begin!r} starts with none of the triggers")
        if structure.get("schema") is None:
            raise InvalidArgument(f"{field}: {where}.schema is required (the JSON schema of the part after begin)")
        schema = json.loads(schema_text(structure["schema"], field, f"{where}.schema"))
        tags.append((max(opened, key=len), begin, schema, end))
    return tags
