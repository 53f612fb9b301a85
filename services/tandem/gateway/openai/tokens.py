"""Token ids -> the strings and bytes OpenAI's logprobs report for them.

`token` is the decode of the one id (special tokens shown, as OpenAI and vLLM show them); `bytes` are the token's
exact bytes. With a byte-level BPE tokenizer (GPT-2, Qwen) a token may be part of a UTF-8 character, whose decode
alone is a replacement character; its bytes then come from the byte-level alphabet, so a client can join tokens'
bytes back into the text.
"""

from __future__ import annotations

import codecs
import math
from functools import cache

from tandem.core.logprobs import TokenLogprob


@cache
def _byte_alphabet() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode: the printable character each byte is written as -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(char): byte for byte, char in zip(printable, chars, strict=True)}


def _byte_level(tokenizer) -> bool:
    try:
        from tokenizers import decoders

        return isinstance(tokenizer.backend_tokenizer.decoder, decoders.ByteLevel)
    except (AttributeError, ImportError):
        return False


class TokenTexts:
    """Cached per id: a vocabulary is small, and logprobs name the same tokens over and over."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.byte_level = _byte_level(tokenizer)
        self.special = frozenset(getattr(tokenizer, "all_special_ids", ()) or ())
        self._cache: dict[int, tuple[str, bytes]] = {}

    def get(self, token_id: int) -> tuple[str, bytes]:
        if (known := self._cache.get(token_id)) is None:
            known = self._cache[token_id] = self._texts(token_id)
        return known

    def _texts(self, token_id: int) -> tuple[str, bytes]:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        if self.byte_level and token_id not in self.special:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            alphabet = _byte_alphabet()
            if piece is not None and all(char in alphabet for char in piece):
                return text, bytes(alphabet[char] for char in piece)
        return text, text.encode()

    def name(self, token_id: int) -> str:
        """The token as the completions API's logprobs name it: its text, or, for part of a UTF-8 character (whose
        decode alone is a replacement character, the same for every such token), `bytes:\\xNN...` as OpenAI
        writes it, so that distinct tokens keep distinct names in `tokens` and `top_logprobs`' keys."""
        text, raw = self.get(token_id)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)
        return text

    def shown_bytes(self, token_id: int) -> bytes:
        """The token's bytes as they appear in the returned text: none for special tokens, which it skips."""
        return b"" if token_id in self.special else self.get(token_id)[1]


FLOOR_LOGPROB = -9999.0  # JSON has no -Infinity (strict encoders refuse it): vLLM's stand-in for an impossible token


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR_LOGPROB


def _entry(texts: TokenTexts, token_id: int, logprob: float) -> dict:
    token, raw = texts.get(token_id)
    return {"token": token, "logprob": finite(logprob), "bytes": list(raw)}


def chat_logprobs(texts: TokenTexts, logprobs: list[TokenLogprob]) -> dict:
    """{"content": [...]}: each token with its bytes and its most likely alternatives."""
    return {"content": [_entry(texts, lp.token_id, lp.logprob)
                        | {"top_logprobs": [_entry(texts, tid, value) for tid, value in lp.top]}
                        for lp in logprobs]}


def vllm_prompt_logprobs(texts: TokenTexts, logprobs: list[TokenLogprob]) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: None for the first token, then per token {token id: {"logprob", "rank",
    "decoded_token"}} holding the token itself and its most likely alternatives (ranks 1, 2, ...)."""
    def entry(token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": finite(logprob), "rank": rank, "decoded_token": texts.get(token_id)[0]}

    return [None] + [{str(tid): entry(tid, value, place) for place, (tid, value) in enumerate(lp.top, 1)}
                     | {str(lp.token_id): entry(lp.token_id, lp.logprob, lp.rank)} for lp in logprobs]


class CompletionLogprobs:
    """The completions API's logprobs of one choice: `text_offset` counts characters across all its chunks."""

    def __init__(self, texts: TokenTexts) -> None:
        self.texts = texts
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._chars = 0

    def format_prompt(self, first_token: int, logprobs: list[TokenLogprob]) -> dict:
        """The echoed prompt's part (`echo`): its first token has no logprob (null, as OpenAI reports it), each
        other token is reported as any token is, with the logprob the target gave it (core.prompt_logprobs);
        text_offset counts on into the completion's tokens. The echoed prompt shows its special tokens (it is the
        prompt as sent), so their text counts here, where the completion's skip theirs."""
        first = {"tokens": [self.texts.name(first_token)], "token_logprobs": [None], "top_logprobs": [None],
                 "text_offset": self._offsets([first_token], specials_shown=True)}
        rest = self.format(logprobs, specials_shown=True)
        return {key: first[key] + rest[key] for key in first}

    def _offsets(self, token_ids: list[int], specials_shown: bool) -> list[int]:
        offsets = []
        for token_id in token_ids:
            offsets.append(self._chars)
            shown = self.texts.get(token_id)[1] if specials_shown else self.texts.shown_bytes(token_id)
            self._chars += len(self._decoder.decode(shown))
        return offsets

    def format(self, logprobs: list[TokenLogprob], specials_shown: bool = False) -> dict:
        """Each token's `top_logprobs` holds its alternatives and the token itself, as OpenAI's legacy API and vLLM
        report them (up to logprobs + 1 entries): a client reads `top_logprobs[i][tokens[i]]`."""
        offsets = self._offsets([lp.token_id for lp in logprobs], specials_shown)
        names = [self.texts.name(lp.token_id) for lp in logprobs]
        return {"tokens": names,
                "token_logprobs": [finite(lp.logprob) for lp in logprobs],
                "top_logprobs": [{self.texts.name(tid): finite(value) for tid, value in lp.top}
                                 | {name: finite(lp.logprob)} for name, lp in zip(names, logprobs, strict=True)],
                "text_offset": offsets}
