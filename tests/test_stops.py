"""Stop strings found exactly, wherever they start, with a bounded search per token, on a real BPE vocabulary."""

from __future__ import annotations

import random

import pytest

from bpe_vocab import LONG_STOP, RARE, WORDS, bpe_decode, bpe_tokenizer, longest_token_chars
from tandem.core.config import SamplingParams
from tandem.core.detok import REPLACEMENT, decoder
from tandem.core.stops import FINISH_LENGTH, FINISH_STOP, StopChecker
from tandem.models.tiny_tokenizer import build_byte_tokenizer


def _check(ids: list[int], stop: tuple[str, ...], decode=bpe_decode, block: int = 1, eos: frozenset[int] = frozenset(),
           max_tokens: int = 10_000) -> tuple[str | None, int | None, list[int]]:
    checker = StopChecker(SamplingParams(max_tokens=max_tokens, stop=stop), eos, decode)
    output: list[int] = []
    for at in range(0, len(ids), block):
        finish, cut = checker.extend(output, ids[at : at + block])
        if finish is not None:
            return finish, cut, output
    return None, None, output


def _ids(text: str) -> list[int]:
    return bpe_tokenizer().encode(text).ids


def test_the_long_stop_token_is_one_real_bpe_token() -> None:
    ids = _ids("hello" + LONG_STOP)
    assert [bpe_decode([i]) for i in ids] == ["hello", LONG_STOP]


@pytest.mark.parametrize("stop", ["STOP", " STOP-", "P---", "-" * 20, "o STOP"])
def test_a_stop_inside_a_long_token_stops_exactly(stop: str) -> None:
    ids = _ids("hello" + LONG_STOP + " world" * 4)
    text = bpe_decode(ids)
    finish, cut, output = _check(ids, (stop,))
    assert finish == FINISH_STOP
    assert output == ids[:2]  # the token completing the stop is appended, nothing after it
    assert cut == text.find(stop)


def test_a_stop_spanning_tokens_stops_on_the_token_completing_it() -> None:
    ids = _ids("the quick brown fox jumps over the lazy dog")
    text = bpe_decode(ids)
    finish, cut, output = _check(ids, ("own fox ju", "zzz"), block=3)
    assert finish == FINISH_STOP and cut == text.find("own fox ju")
    assert "own fox ju" in bpe_decode(output) and "own fox ju" not in bpe_decode(output[:-1])


def test_the_earliest_stop_wins_and_a_stop_token_is_not_appended() -> None:
    ids = _ids("the quick brown fox jumps")
    text = bpe_decode(ids)
    assert _check(ids, ("jumps", "quick brown"), block=8)[1] == text.find("quick brown")
    finish, cut, output = _check(ids, ("jumps",), eos=frozenset({ids[2]}))
    assert (finish, cut, output) == (FINISH_STOP, None, ids[:2])
    assert _check(ids, ("zzz",), max_tokens=3) == (FINISH_LENGTH, None, ids[:3])


def test_a_stop_of_multibyte_characters_split_over_byte_tokens() -> None:
    tokenizer = build_byte_tokenizer()
    decode = decoder(tokenizer)
    ids = tokenizer.encode("naïve 日本語のテキスト 😀 done")
    finish, cut, output = _check(ids, ("本語", "😀"), decode=decode)
    text = decode(ids)
    assert finish == FINISH_STOP and cut == text.find("本語")
    assert output == ids[: len("naïve 日本語".encode())]


def test_random_outputs_stop_where_decoding_the_whole_output_would() -> None:
    tokenizer = bpe_tokenizer()
    rng = random.Random(11)
    for trial in range(80):
        if trial % 2:  # any ids: invalid bytes, characters cut short, special tokens
            ids = [rng.randrange(tokenizer.get_vocab_size()) for _ in range(60)]
        else:
            ids = _ids(" ".join(rng.choices([*WORDS, *RARE, LONG_STOP.strip()], k=20)))
        full = bpe_decode(ids)
        start = rng.randrange(len(full))
        stop = full[start : start + rng.randint(1, 6)]
        if REPLACEMENT in stop:
            continue
        # The reference: the shortest output whose whole decoded text holds the stop.
        n = next(n for n in range(1, len(ids) + 1) if stop in bpe_decode(ids[:n]))
        finish, cut, output = _check(ids, (stop,), block=rng.randint(1, 4))
        assert (finish, cut, output) == (FINISH_STOP, bpe_decode(ids[:n]).find(stop), ids[:n])
        assert full[cut:].startswith(stop)


def test_the_search_per_token_is_bounded_by_the_longest_stop_and_token() -> None:
    tokenizer = bpe_tokenizer()
    ids = _ids(" ".join(random.Random(5).choices(WORDS, k=4000)))
    stops = ("never there", "nor this")
    checker = StopChecker(SamplingParams(max_tokens=len(ids) + 1, stop=stops), frozenset(), bpe_decode)
    bound = max(map(len, stops)) - 1 + longest_token_chars(tokenizer)  # computed once for the vocabulary
    output: list[int] = []
    searched = []
    for token in ids:
        assert checker.extend(output, [token]) == (None, None)
        searched.append(checker.searched)
    assert max(searched) <= bound
    assert output == ids


def test_output_changed_outside_extend_is_picked_up() -> None:
    ids = _ids("hello world the quick brown fox")
    text = bpe_decode(ids)
    checker = StopChecker(SamplingParams(max_tokens=100, stop=("quick",)), frozenset(), bpe_decode)
    output = ids[:3]  # e.g. a resumed output the checker never saw
    finish, cut = checker.extend(output, ids[3:])
    assert finish == FINISH_STOP and cut == text.find("quick")


def test_stop_strings_need_a_decoder() -> None:
    with pytest.raises(ValueError, match="decode"):
        StopChecker(SamplingParams(stop=("x",)), frozenset())
