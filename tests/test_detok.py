"""Incremental detokenization never emits a broken UTF-8 character, never leaks a stop string, and decodes a
bounded window of tokens per push."""

from __future__ import annotations

import random

from bpe_vocab import LONG_STOP, RARE, SPECIAL, WORDS, bpe_decode, bpe_tokenizer
from tandem.core.config import SamplingParams
from tandem.core.detok import MAX_STALL, REPLACEMENT, IncrementalDecoder, IncrementalDetokenizer, decoder
from tandem.core.stops import StopChecker
from tandem.models.tiny_tokenizer import build_byte_tokenizer


def _byte_decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


class CountingDecode:
    """The real decode, recording how many tokens each call decoded."""

    def __init__(self, decode) -> None:
        self.decode, self.sizes = decode, []

    def __call__(self, ids: list[int]) -> str:
        self.sizes.append(len(ids))
        return self.decode(ids)


def _stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> list[str]:
    """Push `ids` in random blocks (as speculative rounds commit them); the last push is final."""
    deltas, at = [], 0
    while at < len(ids):
        block = ids[at : at + rng.randint(1, 5)]
        at += len(block)
        deltas.append(detok.push(block, final=at == len(ids)))
    return deltas


def test_multibyte_characters_wait_for_all_their_bytes() -> None:
    text = "a→b 世界 🙂!"
    data = list(text.encode())
    detok = IncrementalDetokenizer(_byte_decode)
    deltas = [detok.push([byte]) for byte in data[:-1]] + [detok.push([data[-1]], final=True)]
    assert "".join(deltas) == text
    assert all(REPLACEMENT not in d for d in deltas)


def test_characters_split_over_byte_tokens_never_emit_a_replacement() -> None:
    tokenizer = build_byte_tokenizer()  # the tiny models' tokenizer: one token per byte, no merges
    decode = decoder(tokenizer)
    text = "héllo wörld 日本語のテキスト € ∑ 😀 ✓ Привет"
    ids = tokenizer.encode(text)
    assert len(ids) == len(text.encode())  # every multi-byte character is split over tokens
    detok = IncrementalDetokenizer(decode)
    deltas = [detok.push([token]) for token in ids] + [detok.push([], final=True)]
    assert "".join(deltas) == text == decode(ids)
    assert not any(REPLACEMENT in d for d in deltas)
    rng = random.Random(2)
    for _ in range(20):  # blocks that keep ending inside a character: text waits, then commits whole characters
        deltas = _stream(IncrementalDetokenizer(decode), ids * 3, rng)
        assert "".join(deltas) == text * 3 and not any(REPLACEMENT in d for d in deltas)


def test_stream_deltas_concatenate_to_the_final_text() -> None:
    tokenizer = bpe_tokenizer()
    special = tokenizer.token_to_id(SPECIAL)
    rng = random.Random(7)
    vocab = tokenizer.get_vocab_size()
    for trial in range(60):
        if trial % 2:  # anything at all: invalid bytes, special tokens
            ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 80))]
        else:  # text, characters split over tokens, specials between
            words = rng.choices([*WORDS, *RARE, LONG_STOP.strip()], k=rng.randint(1, 20))
            ids = tokenizer.encode(" ".join(words)).ids
            ids[rng.randrange(len(ids)) : 0] = [special]
        final = bpe_decode(ids)
        deltas = _stream(IncrementalDetokenizer(bpe_decode), ids, rng)
        assert "".join(deltas) == final
        offset = 0
        for delta in deltas:  # a replacement streamed is a genuinely invalid byte, not a character cut short
            assert all(final[offset + i] == REPLACEMENT for i, ch in enumerate(delta) if ch == REPLACEMENT)
            offset += len(delta)


def test_stop_string_prefix_is_held_back_and_cut() -> None:
    detok = IncrementalDetokenizer(_byte_decode, stop=("END",))
    out = "".join(detok.push([b]) for b in b"hello E")
    assert out == "hello "  # "E" may start the stop string; the space cannot
    out += detok.push(list(b"ND"), final=True, cut=len("hello "))
    assert out == "hello "


def test_streamed_text_never_leaks_past_a_stop_string() -> None:
    tokenizer = bpe_tokenizer()
    rng = random.Random(3)
    for _ in range(40):
        words = rng.choices([*WORDS, *RARE], k=30)
        ids = tokenizer.encode(" ".join(words)).ids
        full = bpe_decode(ids)
        start = rng.randrange(len(full) - 4)
        stop = full[start : start + rng.randint(1, 4)]
        if not stop.strip():
            continue
        params = SamplingParams(max_tokens=len(ids), stop=(stop,))
        checker, detok = StopChecker(params, frozenset(), bpe_decode), IncrementalDetokenizer(bpe_decode, params.stop)
        output: list[int] = []
        streamed = ""
        at, finish, cut = 0, None, None
        while finish is None:  # as the gateway streams engine steps
            before = len(output)
            finish, cut = checker.extend(output, ids[at : at + rng.randint(1, 4)])
            at = len(output)
            streamed += detok.push(output[before:], final=finish is not None, cut=cut)
            assert stop not in streamed
        assert streamed == full[: full.find(stop)]


def test_decoding_per_push_does_not_grow_with_the_output() -> None:
    tokenizer = bpe_tokenizer()
    ids = tokenizer.encode(" ".join(random.Random(1).choices([*WORDS, *RARE], k=3000))).ids
    counting = CountingDecode(bpe_decode)
    text = IncrementalDecoder(counting)
    windows = []
    for token in ids:
        text.push([token])
        windows.append(text.window)
    # The window is the last committed chunk plus the tokens of a character still incomplete: at most a few.
    assert max(windows) <= 5
    assert max(windows[-1000:]) <= max(windows[:1000])
    assert sum(counting.sizes) <= 6 * len(ids)  # two short decodes per token, never the whole output
    assert text.committed + len(text.flush()) == len(bpe_decode(ids))


def test_runs_of_invalid_bytes_commit_as_decoded_within_a_bounded_window() -> None:
    tokenizer = build_byte_tokenizer()
    decode = decoder(tokenizer)
    stray = tokenizer.encode("é")[1]  # a continuation byte: invalid on its own, and so never a whole character
    ids = tokenizer.encode("ok ") + [stray] * 40 + tokenizer.encode("世界") + [stray] * 3 + tokenizer.encode("🙂!")
    text = IncrementalDecoder(decode)
    deltas, windows = [], []
    for token in ids:
        deltas.append(text.push([token]))
        windows.append(text.window)
    deltas.append(text.flush())
    assert "".join(deltas) == decode(ids)
    assert max(windows) <= 2 * (MAX_STALL + 1)  # a committed run of them, then another waiting
    assert REPLACEMENT in "".join(deltas[: 3 + MAX_STALL + 2])  # committed while the run goes on, not at its end
