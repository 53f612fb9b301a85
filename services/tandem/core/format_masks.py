"""Structured outputs: a response format (a JSON schema, a regular expression, a tool call's grammar) masks the logits
of draft and target alike, so every token sampled keeps the output a prefix of a match and the output ends (EOS)
only at a whole match.

llguidance compiles the format and, for a sequence's output so far, tells which token ids may come next (a bitmask:
bit t of word t // 32). A verification scores k + 1 positions at once; position i is masked by the format after the
output plus the first i drafted tokens, which is the mask plain decoding applies there, so each position is verified
against the distribution plain decoding samples and speculation stays lossless. At the first drafted token the
format refuses the walk stops: that draft has probability 0 under the masked target and is rejected, so no later
position is read. The draft masks its own steps the same way, so its proposals are ones the target can accept.

Each side keeps one matcher per sequence and moves it with the sequence: forward by the tokens the output gained,
back (llguidance's rollback) by the drafts a verification rejected.

A format that fails on its output refuses that request alone (RequestRefused; its step's other rows run again
without it): llguidance's parser stops at its limits, and a client's ambiguous grammar can cost more with every
token before it gets there (`start: e` / `e: e e | "a"` took 76 ms a token after 400 characters, 1 s after 1,000,
stalling every row batched with it), so a row whose masks take longer than `row_budget_s` in one call is refused too.
The budget counts the CPU time of the thread that computes them (`time.thread_time`), not the wall time: on a loaded
machine a row waiting for a core is not a costly format, and a new request's matcher, built once, is not counted, nor
is Python's garbage collector running in that thread meanwhile (a full collection among thousands of live sequences
took up to 0.4 s of a test's thread: a row it fell in was refused for it).
"""

from __future__ import annotations

import gc
import threading
import time
import types
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from llguidance import LLExecutor, LLMatcher, LLTokenizer

from tandem.core.config import OutputFormat
from tandem.core.device import on_device
from tandem.core.formats import format_tokenizer, grammar_of
from tandem.core.protocol import DraftRequest, VerifyRequest
from tandem.core.sequence import SequenceState
from tandem.errors import RequestRefused

_BITS = 32  # token ids per bitmask word
MAX_REASON_CHARS = 200  # of llguidance's error, in a refusal
# A row's masks for one call (its output's new tokens consumed, then k + 1 positions): a JSON schema's take 1-3 ms on
# a loaded 2-core CPU (docs/performance.md, Structured outputs); past this, plus TOKEN_BUDGET_S for each output token
# the call moves its matcher through (a resend carries a whole output: JSON's cost 2 us a token on CPU-A), the
# format is refused.
ROW_BUDGET_S = 0.1
TOKEN_BUDGET_S = 1e-4


class _CpuClock:
    """The calling thread's CPU seconds outside Python's garbage collector (whose passes run in whichever thread
    allocated last, and are that thread's time, not the format's)."""

    def __init__(self) -> None:
        self._local = threading.local()
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        local = self._local
        if phase == "start":
            local.started = time.thread_time()
        elif (started := getattr(local, "started", None)) is not None:
            local.collected = getattr(local, "collected", 0.0) + time.thread_time() - started
            local.started = None

    def __call__(self) -> float:
        return time.thread_time() - getattr(self._local, "collected", 0.0)


_cpu = _CpuClock()


@dataclass(slots=True)
class _Tracked:
    output_format: OutputFormat
    matcher: LLMatcher
    consumed: list[int] = field(default_factory=list)  # the output tokens the matcher has moved through


class FormatMasks:
    """One side's matchers (a drafter's or a verifier's), a matcher per sequence whose request has a format.
    `tokenizer` (Hugging Face's) becomes llguidance's on the first such request, unless the server built it ahead
    (core.formats.build_in_background: workers and gateways do as they start).
    `parallel`: compute a step's rows on llguidance's threads; None decides by the logits' device (not on a CPU).
    `row_budget_s`: the seconds a row's masks may take in one call before its request is refused, plus
    `token_budget_s` per output token the call moves the row's matcher through (None: no limit, for ranks of a
    tensor-parallel group that must all refuse alike)."""

    def __init__(self, tokenizer: Any, eos_token_ids: Collection[int], parallel: bool | None = None,
                 row_budget_s: float | None = ROW_BUDGET_S, token_budget_s: float = TOKEN_BUDGET_S) -> None:
        self.parallel, self.row_budget_s, self.token_budget_s = parallel, row_budget_s, token_budget_s
        self._source = (tokenizer, frozenset(eos_token_ids))
        self._eos = frozenset(eos_token_ids)
        self._tracked: dict[str, _Tracked] = {}

    @property
    def tokenizer(self) -> LLTokenizer:
        return format_tokenizer(*self._source)

    def __len__(self) -> int:
        return len(self._tracked)

    def release(self, seq_id: str) -> None:
        self._tracked.pop(seq_id, None)

    def keep_only(self, live: Collection[str]) -> None:
        """Drop the matchers of sequences the side no longer holds (released without a word to this object)."""
        for seq_id in [s for s in self._tracked if s not in live]:
            del self._tracked[seq_id]

    def apply(self, logits: torch.Tensor, wants: list[int], requests: Sequence[VerifyRequest | DraftRequest],
              states: list[SequenceState], committed: list[int], drafts: list[list[int]]) -> torch.Tensor:
        """Logits of `wants` positions a row, with each formatted request's positions masked (-inf where the format
        refuses the token): position i of a row follows its output (its state's tokens from the request's
        output_start to `committed`) and its first i drafts. A new float32 tensor unless no request has a format.
        Positions past the format's end are left as they are, on both sides alike, so that a drafter and a verifier
        of the same model agree there: past an EOS, or a token the format refuses (the walk stops at a refused draft;
        a drafter's output holds one where its step allowed nothing of the vocabulary it scores). None of them is
        ever emitted."""
        if not any(request.params.output_format for request in requests):
            return logits
        masks = torch.full((sum(wants), self._words), -1, dtype=torch.int32)  # all -1: left as it is
        walks: list[tuple[LLMatcher, int, list[int]]] = []
        alone: list[tuple[LLMatcher, int]] = []
        rows: list[tuple[str, LLMatcher, int, list[int], float]] = []  # seq id, matcher, row, drafts, seconds so far
        at = 0
        for request, state, length, tokens, width in zip(requests, states, committed, drafts, wants, strict=True):
            if request.params.output_format is not None:
                started = _cpu()
                before = len(self._tracked[request.seq_id].consumed) if request.seq_id in self._tracked else 0
                tracked, built = self._sync(request.seq_id, request.params.output_format,
                                            state.tokens[request.output_start : length])
                if tracked is not None:
                    walk = list(tokens[: width - 1])
                    # Time spent beyond building the matcher and what moving through the output's new tokens is
                    # allowed.
                    spent = (_cpu() - started - built
                             - self.token_budget_s * max(0, len(tracked.consumed) - before))
                    rows.append((request.seq_id, tracked.matcher, at, walk, spent))
                    if walk:
                        walks.append((tracked.matcher, at, walk))
                    else:
                        alone.append((tracked.matcher, at))
            at += width
        # Within a row, position i + 1's mask follows draft i, up to the first draft the format refuses or an EOS
        # (the masks after it are not written), and the matcher is rolled back to the output afterwards.
        if not (self.parallel if self.parallel is not None else logits.device.type != "cpu"):
            # One row after another: llguidance's threads, spinning beside the model's own on the same cores, made
            # plain decoding under a schema 0.80x as fast at batch 1 (5.29 against 6.61 tok/s on 2 cores,
            # docs/bench/format-masks-threads-v1.json).
            for seq_id, matcher, at, walk, spent in rows:
                started = _cpu()
                self._walk(matcher, masks, at, walk)
                self._check(seq_id, matcher, spent + _cpu() - started)
        else:  # rows in parallel, on cores the model's forwards leave idle (timed in _sync only)
            if walks:
                _fillers().fill_next_token_bitmask_par_with_draft_tokens(_executor(), walks, masks)
            if alone:
                _fillers().fill_next_token_bitmask_par(_executor(), alone, masks)
            for seq_id, matcher, _, _, spent in rows:
                self._check(seq_id, matcher, spent)
        written = (masks != -1).any(dim=1).nonzero().flatten()  # a written mask leaves ids past the vocabulary out
        part = _unpack(on_device(masks[written], logits.device), logits.shape[-1])
        part |= ~part.any(dim=-1, keepdim=True)  # nothing of the scored vocabulary: left as it is
        allowed = torch.ones(logits.shape, dtype=torch.bool, device=logits.device)
        allowed[on_device(written, logits.device)] = part
        # One pass that also makes the new float32 tensor: writing -inf into the rows picked by index cost 1.45x as
        # much (17.6 against 12.2 ms for 40 positions of a 152k vocabulary on 2 cores, format-masks-unpack-v1.json).
        logits = torch.where(allowed, logits.to(torch.float32), float("-inf"))
        return logits

    def _check(self, seq_id: str, matcher: LLMatcher, seconds: float) -> None:
        """Refuse the sequence's request where its format failed (llguidance's parser hit a limit) or its masks took
        longer than the budget; its matcher is dropped with it."""
        if matcher.is_error():
            self.release(seq_id)
            raise RequestRefused(seq_id, f"response_format: the format failed on this output: "
                                         f"{_reason(matcher.get_error())}")
        if self.row_budget_s is not None and seconds > self.row_budget_s:
            self.release(seq_id)
            raise RequestRefused(seq_id, f"response_format: following the format took {1e3 * seconds:.0f} ms for one "
                                 f"step of this output, past this server's limit of {1e3 * self.row_budget_s:.0f} ms; "
                                 "an ambiguous grammar's parse grows with the output: make it unambiguous")

    def _walk(self, matcher: LLMatcher, masks: torch.Tensor, at: int, drafts: list[int]) -> None:
        """What fill_next_token_bitmask_par_with_draft_tokens does for one row, on this thread."""
        fill = _fillers().fill_next_token_bitmask
        fill(matcher, masks, at)
        walked = 0
        for token in drafts:
            word = int(masks[at + walked, token // _BITS]) if token // _BITS < masks.shape[1] else 0
            if token in self._eos or not (word >> (token % _BITS)) & 1 or not matcher.consume_token(token):
                break
            walked += 1
            fill(matcher, masks, at + walked)
        if walked:
            matcher.rollback(walked)

    @property
    def _words(self) -> int:
        return (self.tokenizer.vocab_size + _BITS - 1) // _BITS

    def _sync(self, seq_id: str, output_format: OutputFormat, output: list[int]) -> tuple[_Tracked | None, float]:
        """The sequence's matcher, moved to the end of `output`: back past what the output no longer holds (rejected
        drafts), then forward through what it gained; None where the output has left the format (an EOS, a token
        it refuses). And the thread's CPU seconds spent building the matcher (0 where it was built before)."""
        tracked, built = self._tracked.get(seq_id), 0.0
        if tracked is None or tracked.output_format != output_format:
            started = _cpu()
            _fillers()  # imported with the process's first matcher (about 1 s): building, not a step's masks
            matcher = LLMatcher(self.tokenizer, grammar_of(output_format))
            built = _cpu() - started
            if matcher.is_error():
                raise RequestRefused(seq_id, f"response_format: {_reason(matcher.get_error())}")
            tracked = self._tracked[seq_id] = _Tracked(output_format, matcher)
        consumed = tracked.consumed
        same = _common_prefix(consumed, output)
        if same < len(consumed):
            tracked.matcher.rollback(len(consumed) - same)
            del consumed[same:]
        gained = output[same:]
        ended = next((index for index, token in enumerate(gained) if token in self._eos), len(gained))
        # Never through an EOS: llguidance's rollback would not count it.
        moved = tracked.matcher.try_consume_tokens(gained[:ended]) if ended else 0
        consumed.extend(gained[:moved])
        self._check(seq_id, tracked.matcher, 0.0)  # a parser limit hit on the way
        return (tracked if moved == len(gained) else None), built


_executors: list[LLExecutor] = []


def _executor() -> LLExecutor:
    """One pool of llguidance threads per process (80% of the CPUs, at most 32)."""
    if not _executors:
        _executors.append(LLExecutor())
    return _executors[0]


def _fillers() -> types.ModuleType:
    """llguidance.torch, whose functions write the masks: imported with the process's first matcher, since importing
    it compiles a function of its own with torch.compile, which loads dynamo and inductor (1.3 s of every start)."""
    import llguidance.torch

    return llguidance.torch


def _common_prefix(left: list[int], right: list[int]) -> int:
    n = min(len(left), len(right))
    if left[:n] == right[:n]:
        return n
    return next(i for i in range(n) if left[i] != right[i])


# Byte value -> its 8 bits, lowest first: a bitmask word's bytes in memory order (little-endian, as on every CPU and
# GPU torch runs on) are then its token ids in order. Looked up per byte (an embedding), unpacking ran 2.4x faster than
# shifting each word 32 ways (1.34 against 3.24 ms for 40 positions of a 152k vocabulary on 2 cores).
_BYTE_BITS = ((torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1).to(torch.uint8)


def _unpack(masks: torch.Tensor, vocab: int) -> torch.Tensor:
    """[n, words] int32 bitmasks -> [n, vocab] bool (ids past the masks' bits: refused)."""
    table = on_device(_BYTE_BITS, masks.device)
    bits = torch.nn.functional.embedding(masks.view(torch.uint8).long(), table).flatten(1).bool()
    if bits.shape[1] >= vocab:
        return bits[:, :vocab]
    return torch.cat([bits, bits.new_zeros(bits.shape[0], vocab - bits.shape[1])], dim=1)


def _reason(error: str) -> str:
    """llguidance's error for a client: its first line (a stop reason such as NoExtensionBias: the format allows no
    token here), without the parser's state dump after it (internals, and this server's own grammar settings)."""
    first = error.strip().split("\n", 1)[0][:MAX_REASON_CHARS]
    return f"{first} (the format allows no token here)" if first == "NoExtensionBias" else first or "failed"
