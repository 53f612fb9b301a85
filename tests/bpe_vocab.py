"""A small byte-level BPE trained offline with `tokenizers`: real merges, one long "STOP" + 20 dashes token, and
rare multi-byte characters left split over byte tokens."""

from __future__ import annotations

import random
from functools import cache

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL = "<|endoftext|>"
LONG_STOP = " STOP" + "-" * 20
WORDS = ("hello", "world", "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "tokens", "stream")
RARE = ("héllo", "naïve", "café", "日本語", "世界", "🙂", "Привет", "→")


def _corpus(lines: int = 400) -> list[str]:
    rng = random.Random(0)
    corpus = []
    for i in range(lines):
        words = [rng.choice(WORDS) for _ in range(8)]
        if i % 2 == 0:
            words.insert(rng.randrange(len(words)), LONG_STOP.strip())
        if i % 3 == 0:
            words.insert(rng.randrange(len(words)), rng.choice(RARE))
        corpus.append(" ".join(words))
    return corpus


@cache
def bpe_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    # Words keep their punctuation (unlike GPT-2's split), so the dashes merge into the STOP token.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r" ?\S+|\s+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    # min_frequency keeps the rare words' characters as byte tokens, so characters split over tokens.
    trainer = trainers.BpeTrainer(vocab_size=400, min_frequency=12, special_tokens=[SPECIAL], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_corpus(), trainer)
    return tokenizer


def bpe_decode(token_ids: list[int]) -> str:
    """What the engine decodes with (local_engine.decoder): special tokens skipped."""
    return bpe_tokenizer().decode(token_ids, skip_special_tokens=True)


def longest_token_chars(tokenizer: Tokenizer) -> int:
    return max(len(tokenizer.decode([i])) for i in range(tokenizer.get_vocab_size()))
