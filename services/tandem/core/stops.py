"""Stop conditions applied token by token, so a stop inside an accepted block ends the output exactly there."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.core.config import SamplingParams

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"


@dataclass(slots=True)
class StopChecker:
    params: SamplingParams
    eos_token_ids: frozenset[int]
    decode: Callable[[list[int]], str] | None = None
    stop_ids: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        eos = frozenset() if self.params.ignore_eos else self.eos_token_ids
        self.stop_ids = eos | frozenset(self.params.stop_token_ids)
        if self.params.stop and self.decode is None:
            raise ValueError("stop strings need a tokenizer to decode with")

    def extend(self, output: list[int], new_tokens: list[int]) -> tuple[str | None, int | None]:
        """Append tokens to `output` up to the first stop.

        Returns (finish reason or None, text cut: the length of the decoded output before a stop string).
        Stop tokens (EOS, stop_token_ids) are not appended; the token completing a stop string is.
        """
        for token in new_tokens:
            if token in self.stop_ids:
                return FINISH_STOP, None
            output.append(token)
            if self.params.stop:
                cut = self._stop_string_cut(output)
                if cut is not None:
                    return FINISH_STOP, cut
            if len(output) >= self.params.max_tokens:
                return FINISH_LENGTH, None
        return None, None

    def _stop_string_cut(self, output: list[int]) -> int | None:
        text = self.decode(output)
        window = max(len(s) for s in self.params.stop) + 16
        tail_start = max(0, len(text) - window)
        hits = [i for s in self.params.stop if (i := text.find(s, tail_start)) >= 0]
        return min(hits) if hits else None
