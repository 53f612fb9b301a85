"""CPU cost of streaming one long output's text: the whole-output decoders (before issue 11) against the
incremental ones, each as the gateway runs them per engine step (StopChecker.extend, then
IncrementalDetokenizer.push).

Two real tokenizers, built offline: the tiny models' byte-level tokenizer (one token per byte) and a byte-level BPE
trained here on the repository's prompt sets (real merges, several characters per token). Stop strings
that never match make the stop checker search to the end, its worst case.

    python -m tandem.bench.detok --json docs/bench/detok-v1.json     # about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from collections.abc import Callable
from importlib import resources

import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tandem.cli.options import (
    DefaultsHelpFormatter,
    add_json_option,
    at_least,
    refuse_bad_values,
    wants_text,
    write_json,
)
from tandem.core.config import SamplingParams
from tandem.core.detok import IncrementalDetokenizer, decoder
from tandem.core.stops import StopChecker
from tandem.models.tiny_tokenizer import QWEN2_PRETOKENIZE_REGEX, build_byte_tokenizer

STOPS = ("</answer>", "\n\nUser:")
# The tokens of the first and of the last window a run reports the cost per token of ("first_1k", "last_1k"): the old
# path's cost grows with the output, the new one's should not. --tokens is at least this.
WINDOW = 1024
UNICODE = "Ünïcödé → 日本語のテキスト, Привет мир, 😀 ✓ € ∑. "


class OldDetokenizer:
    """IncrementalDetokenizer before issue 11: the whole output decoded on every push."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...] = ()) -> None:
        self.decode, self.holdback = decode, max((len(s) for s in stop), default=1) - 1
        self.tokens: list[int] = []
        self.emitted = 0

    def push(self, token_ids: list[int], final: bool = False, cut: int | None = None) -> str:
        self.tokens.extend(token_ids)
        text = self.decode(self.tokens)
        if cut is not None:
            text = text[:cut]
        if not final:
            text = text.rstrip("\ufffd")
            text = text[: max(self.emitted, len(text) - self.holdback)]
        delta = text[self.emitted :]
        self.emitted = max(self.emitted, len(text))
        return delta


class OldStopChecker(StopChecker):
    """StopChecker's stop-string search before issue 11: the whole output decoded on every token."""

    __slots__ = ()

    def _stop_string_cut(self, output: list[int]) -> int | None:
        text = self.decode(output)
        tail_start = max(0, len(text) - max(len(s) for s in self.params.stop) - 16)
        hits = [i for s in self.params.stop if (i := text.find(s, tail_start)) >= 0]
        return min(hits) if hits else None


def corpus() -> list[str]:
    """The repository's prompt sets (data files, so the figures stay comparable across runs)."""
    texts = [UNICODE]
    files = (resources.files("tandem.bench").joinpath("prompts.jsonl"),
             *(resources.files("loadtest").joinpath("prompts", name) for name in ("code.jsonl", "chat.jsonl")))
    for file in files:
        for line in file.read_text(encoding="utf-8").splitlines():
            item = json.loads(line)
            texts += [item["prompt"]] if "prompt" in item else [m["content"] for m in item["messages"]]
    return texts


def trained_bpe(vocab_size: int) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(corpus(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False)


def output_ids(tokenizer: PreTrainedTokenizerFast, tokens: int) -> list[int]:
    """`tokens` ids of the prompt sets' text with multi-byte characters mixed in, as a model's output might be."""
    lines = [text + (" " + UNICODE if i % 7 == 0 else "") + "\n\n" for i, text in enumerate(corpus())]
    ids: list[int] = []
    while len(ids) < tokens:
        ids += [t for line in lines for t in tokenizer.encode(line, add_special_tokens=False)]
    return ids[:tokens]


def stream(ids: list[int], decode, checker_type: type[StopChecker], detok_type, rounds: list[int]) -> dict:
    """Commit `ids` in speculative rounds of the given sizes; time the stop checks and the detokenizer."""
    checker = checker_type(SamplingParams(max_tokens=len(ids), stop=STOPS), frozenset(), decode)
    detok = detok_type(decode, STOPS)
    output: list[int] = []
    text, at, marks = [], 0, []
    started = time.perf_counter()
    for size in rounds:
        before = len(output)
        finish, cut = checker.extend(output, ids[at : at + size])
        at = len(output)
        text.append(detok.push(output[before:], final=finish is not None, cut=cut))
        marks.append((at, time.perf_counter() - started))
        if finish is not None:
            break
    seconds = time.perf_counter() - started
    assert "".join(text) == decode(ids), "the streamed text is not the output's text"
    first = next(t for n, t in marks if n >= WINDOW)
    last = seconds - next(t for n, t in marks if n >= len(ids) - WINDOW)
    return {"rounds": len(marks), "seconds": round(seconds, 4), "us_per_token": round(1e6 * seconds / len(ids), 2),
            "us_per_token_first_1k": round(1e6 * first / WINDOW, 2),
            "us_per_token_last_1k": round(1e6 * last / WINDOW, 2)}


def bench(name: str, tokenizer: PreTrainedTokenizerFast, tokens: int, repeats: int) -> dict:
    ids = output_ids(tokenizer, tokens)
    decode = decoder(tokenizer)  # what the engine and gateway decode with
    rng = random.Random(0)
    rounds = [rng.randint(1, 5) for _ in range(tokens)]  # k + 1 tokens committed per speculative round
    results = {"tokenizer": name, "vocab": len(tokenizer), "tokens": tokens,
               "chars": len(decode(ids))}
    for label, checker, detok in (("old", OldStopChecker, OldDetokenizer),
                                  ("new", StopChecker, IncrementalDetokenizer)):
        runs = [stream(ids, decode, checker, detok, rounds) for _ in range(repeats if label == "new" else 1)]
        results[label] = min(runs, key=lambda r: r["seconds"])
    results["speedup"] = round(results["old"]["seconds"] / results["new"]["seconds"], 1)
    return results


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse bad values before any work: one line naming the flag, exit status 2, as the tandem CLI does. Fewer
    tokens than a window are refused rather than the windows shrunk: the report's first and last 1k would then
    measure something else under the same names."""
    checks = [("tokens", args.tokens >= WINDOW, f"must be at least {WINDOW} (the report's {WINDOW}-token windows), "
                                                f"got {args.tokens}"),
              *at_least(args, repeats=1)]
    refuse_bad_values(parser, checks)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192, help="output tokens streamed")
    parser.add_argument("--repeats", type=int, default=3, help="runs of the new path; the fastest counts")
    add_json_option(parser, "the results")
    args = parser.parse_args(argv)
    _check_args(parser, args)
    report = {
        "what": "StopChecker.extend + IncrementalDetokenizer.push per speculative round (1-5 tokens), stops "
                f"{list(STOPS)} never matching; old = whole-output decode per token/push (before issue 11)",
        "python": platform.python_version(), "tokenizers": tokenizers.__version__, "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),  # other work on the machine slows both paths
        "results": [bench("tiny-byte-level", build_byte_tokenizer(), args.tokens, args.repeats),
                    bench("bpe-1024-trained", trained_bpe(1024), args.tokens, args.repeats)],
    }
    if wants_text(args):
        print(json.dumps(report, indent=2))
    write_json(args.json, report)


if __name__ == "__main__":
    main()
