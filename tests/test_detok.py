"""Incremental detokenization never emits a broken UTF-8 character and never leaks a stop string."""

from __future__ import annotations

from tandem.core.detok import IncrementalDetokenizer


def _byte_decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def test_multibyte_characters_wait_for_all_their_bytes() -> None:
    text = "a→b 世界 🙂!"
    data = list(text.encode())
    detok = IncrementalDetokenizer(_byte_decode)
    deltas = [detok.push([byte]) for byte in data[:-1]] + [detok.push([data[-1]], final=True)]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_prefix_is_held_back_and_cut() -> None:
    detok = IncrementalDetokenizer(_byte_decode, stop=("END",))
    out = "".join(detok.push([b]) for b in b"hello E")
    assert out == "hello"  # "E" (and the space before it) may start the stop string
    out += detok.push(list(b"ND"), final=True, cut=len("hello "))
    assert out == "hello "
