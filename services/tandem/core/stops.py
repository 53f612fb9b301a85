"""Stop conditions applied token by token, so a stop inside an accepted block ends the output exactly there.

Stop strings are matched against text built incrementally (core.detok.IncrementalDecoder): each token searches
only the last longest-stop - 1 characters already seen plus the text this token added, so the cost per token is
bounded by the longest stop and the longest token's text, never by the output's length, and a stop string inside
one long token is found wherever in it it starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.core.config import SamplingParams
from tandem.core.detok import Decode, IncrementalDecoder

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"


@dataclass(slots=True)
class StopChecker:
    params: SamplingParams
    eos_token_ids: frozenset[int]
    decode: Decode | None = None
    stop_ids: frozenset[int] = field(init=False)
    searched: int = field(init=False, default=0)  # characters the last stop-string check looked at
    _text: IncrementalDecoder | None = field(init=False, default=None)
    _tail: str = field(init=False, default="")  # the last longest-stop - 1 committed characters

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
        """Where the first stop string the newest token completes starts in the output's text, if it completes one."""
        if self._text is None or self._text.count != len(output) - 1:
            self._restart(output[:-1])  # first call, or `output` changed other than through extend
        text = self._text
        start = text.committed - len(self._tail)
        committed = text.push(output[-1:])
        # A stop ending before this token's text would have stopped an earlier token: search only what may end here.
        window = self._tail + committed + text.stable_pending
        self.searched = len(window)
        hits = [i for s in self.params.stop if (i := window.find(s)) >= 0]
        self._keep_tail(committed)
        return start + min(hits) if hits else None

    def _restart(self, output: list[int]) -> None:
        self._text, self._tail = IncrementalDecoder(self.decode), ""
        self._keep_tail(self._text.push(output))

    def _keep_tail(self, committed: str) -> None:
        keep = max(len(s) for s in self.params.stop) - 1
        tail = self._tail + committed
        self._tail = tail[max(0, len(tail) - keep) :] if keep else ""
