"""Response formats compiled for llguidance, with no torch: the gateways check a request's format with these before
any worker sees it, and the workers' masks (core.format_masks) compile it the same way."""

from __future__ import annotations

import logging
import re
import threading
import weakref
from collections.abc import Collection
from typing import Any

from llguidance import LLMatcher, LLTokenizer, StructTag
from llguidance.gbnf_to_lark import any_to_lark

from tandem.core.config import OutputFormat
from tandem.errors import InvalidArgument
from tandem.response_format import structural_tags

log = logging.getLogger(__name__)
_built: weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], LLTokenizer]] = weakref.WeakKeyDictionary()
_building = threading.Lock()


def format_tokenizer(tokenizer: Any, eos_token_ids: Collection[int]) -> LLTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer, ending outputs at `eos_token_ids` (the ids the engine
    stops at). Built once per tokenizer object and kept: it takes about 1.4 s for a 152k vocabulary."""
    import llguidance.hf  # imports transformers, which a gateway's front end leaves until its models load

    eos = tuple(sorted(eos_token_ids))
    with _building:
        known = _built.setdefault(tokenizer, {})
        if eos not in known:
            known[eos] = llguidance.hf.from_tokenizer(tokenizer, eos_token=list(eos))
        return known[eos]


def build_in_background(tokenizer: Any, eos_token_ids: Collection[int]) -> threading.Thread:
    """Start building `format_tokenizer(tokenizer, eos_token_ids)` on a daemon thread, so that a server's first
    formatted request does not wait for it (a request that comes sooner waits for this build, not a second one). A
    failure is only logged: the first formatted request builds it again and reports why."""
    def build() -> None:
        try:
            format_tokenizer(tokenizer, eos_token_ids)
        except Exception:  # a request that needs it raises the same error with its own context
            log.warning("building llguidance's tokenizer ahead of requests failed", exc_info=True)

    thread = threading.Thread(target=build, name="format-tokenizer", daemon=True)
    thread.start()
    return thread


# Whitespace between JSON tokens: any, as models write pretty-printed JSON, but at most 32 characters in one place. With
# llguidance's default (unbounded) a weak model can spend every token left on newlines inside a valid prefix, as a
# random-weight model does at once. A schema's own "x-guidance" options override this (llguidance's JSON options).
JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{1,32}"}


def grammar_of(output_format: OutputFormat) -> str:
    """The llguidance grammar of a format; InvalidArgument where llguidance cannot take it (a schema nested past its
    recursion limit raised a ValueError, a 500)."""
    try:
        return _grammar_of(output_format)
    except InvalidArgument:
        raise
    except ValueError as exc:
        raise InvalidArgument(f"response_format: {exc}") from None


def _grammar_of(output_format: OutputFormat) -> str:
    if output_format.kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(output_format.spec, defaults=JSON_OPTIONS)
    if output_format.kind == "lark":
        return LLMatcher.grammar_from_lark(output_format.spec)
    if output_format.kind == "grammar":  # a client's: llguidance's Lark, or llama.cpp's GBNF converted to it
        try:
            lark = any_to_lark(output_format.spec)
        except Exception as exc:  # GbnfToLarkError, or a bare Exception for a GBNF grammar without a root rule
            raise InvalidArgument(f"response_format: the grammar is neither Lark nor GBNF: {exc}") from None
        return LLMatcher.grammar_from_lark(lark)
    if output_format.kind == "structural_tag":  # free text with tagged parts: llguidance's own lazy triggers
        tags = [StructTag(trigger=trigger, begin=begin, grammar=schema, end=end)
                for trigger, begin, schema, end in structural_tags(output_format.spec)]
        return LLMatcher.grammar_from_lark(StructTag.to_grammar(tags))
    return LLMatcher.grammar_from_regex(output_format.spec)


def check_format(output_format: OutputFormat, tokenizer: LLTokenizer) -> None:
    """Raise InvalidArgument with llguidance's reason where the format does not compile (a schema keyword it does
    not implement, an expression that does not parse)."""
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar_of(output_format), tokenizer)
    if failed:
        reason = messages[0] if messages else "does not compile"
        if output_format.kind == "structural_tag":
            # llguidance places it in the grammar built from the tag, which the client never wrote: the reason alone
            reason = re.sub(r"^at \d+\(\d+\): ", "", reason.splitlines()[0])
        raise InvalidArgument(f"response_format: {reason}")
