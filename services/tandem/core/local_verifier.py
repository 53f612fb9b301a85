"""The in-process verifier: scores every row's drafts in one forward over a ModelRunner and accepts them (greedy, or
min(1, p/q) with the residual and bonus: core.rejection), with the logprobs a request asked for."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from tandem.core.decode_steps import decode_more
from tandem.core.device import on_device
from tandem.core.logprobs import TokenLogprob
from tandem.core.model_side import ModelSide, apply_formats, key_seed, sync_all
from tandem.core.penalties import verification_logits
from tandem.core.prompt_logprobs import split_prompt_rows
from tandem.core.protocol import VerifyRequest, VerifyResult
from tandem.core.rejection import accept_greedy, accept_sampled
from tandem.core.runner import ModelRunner
from tandem.core.sampling import (
    ACCEPT_STREAM,
    SAMPLE_STREAM,
    SparseDist,
    greedy_tokens,
    gumbel_choice,
    keyed_uniforms,
    processed_probs,
    sample_index,
)
from tandem.core.sequence import SequenceState

if TYPE_CHECKING:  # core.format_masks needs llguidance, which a runner alone (the GPU probe's) does without
    from tandem.core.format_masks import FormatMasks


class LocalVerifier(ModelSide):
    """formats: the verifier's matchers for requests with a response format (core.format_masks); a verifier without them
    refuses such requests."""

    def __init__(self, runner: ModelRunner, formats: FormatMasks | None = None) -> None:
        super().__init__(runner, formats)
        self.vocab_size = runner.vocab_size
        self.context_window = runner.context_window
        self.row_layout = runner.layout

    def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        states, reused = sync_all(self.runner, requests)
        results = [VerifyResult.prefill_goes_on()] * len(requests)  # the rows scored below replace theirs
        scoring, uptos = [], []
        for index, (request, state) in enumerate(zip(requests, states, strict=True)):
            if request.score_prompt:  # the whole prompt goes into the scoring forward (core.prompt_logprobs)
                state.truncate_cache(0)
                uptos.append(0)
                scoring.append(index)
                continue
            uncached = len(state.pending) - 1  # everything but the last token is cached before scoring
            if 0 < request.prefill_limit < uncached:
                uptos.append(state.cached + request.prefill_limit)
                continue
            uptos.append(len(state.tokens) - 1)
            scoring.append(index)
        if scoring and self.runner.fits_one_forward([states[i] for i in scoring]):
            for index in scoring:  # their prompts go into the forward that scores them (a lone or all-new batch)
                uptos[index] = states[index].cached
        self.runner.prefill_many(states, uptos)  # prompts (or chunks of them) arriving together share forwards
        if scoring:
            for index, result in zip(scoring, self._score([requests[i] for i in scoring], [states[i] for i in scoring]),
                                     strict=True):
                results[index] = result
        return [dataclasses.replace(r, cached_prompt=n) if n else r for r, n in zip(results, reused, strict=True)]

    def _score(self, requests: list[VerifyRequest], states: list[SequenceState]) -> list[VerifyResult]:
        drafts = [r.draft.tokens if r.draft else [] for r in requests]
        committed = [len(state.tokens) for state in states]
        for state, tokens in zip(states, drafts, strict=True):
            state.tokens.extend(tokens)
        wants = [len(tokens) + 1 for tokens in drafts]
        # A row scoring its prompt feeds it whole: its positions before the last committed token come first.
        before = [length - 1 if r.score_prompt else 0 for r, length in zip(requests, committed, strict=True)]
        scores_prompts = any(r.score_prompt for r in requests)  # then the logits come a part at a time
        raw = self.runner.forward_on_device(states, [w + b for w, b in zip(wants, before, strict=True)],
                                            head=not scores_prompts)
        if scores_prompts:
            raw, prompts = split_prompt_rows(raw, self.runner.logits, wants, before, requests, states)
        else:
            prompts = {}
        # Every row's outcome is computed on the device; the host receives them in one transfer.
        shaped = verification_logits(raw, wants, requests, states, committed, drafts)
        logits = apply_formats(self.formats, self.runner, shaped, wants, requests, states, committed, drafts)
        row_logits = logits.split(wants)
        # Greedy rows' choices in one reduction over the step's logits: one per row took twice as long (0.72 against
        # 0.36 ms for 8 rows of 152k bf16 logits on 2 cores, docs/bench/greedy-choice-v1.py).
        greedy = greedy_tokens(logits).split(wants) if any(r.params.greedy for r in requests) else None
        outcomes = [greedy[index] if request.params.greedy else self._accept(request, rows, tokens, length)
                    for index, (request, rows, tokens, length)
                    in enumerate(zip(requests, row_logits, drafts, committed, strict=True))]
        # Queued before the outcomes' transfer, so that its own transfer (rows that asked only) finds it done.
        # Logprobs are the model's own: from the logits before any penalty or bias.
        scores = _score_logprobs(requests, raw.split(wants), drafts, outcomes)
        # Plain rows asked for several steps go on decoding, fed their choices on the device (core.decode_steps).
        more = decode_more(self.runner, requests, states, outcomes, committed,
                           lambda request, logits, position: self._accept(request, logits, [], position))
        host = torch.cat(outcomes + list(more.values())).tolist() if outcomes else []
        further, at = {}, sum(len(outcome) for outcome in outcomes)
        for index, decoded in more.items():  # their tokens follow the outcomes, in this order
            further[index] = tuple(int(token) for token in host[at : at + len(decoded)])
            at += len(decoded)
        results, at = [], 0
        for index, (request, state, tokens, length, outcome) in enumerate(
                zip(requests, states, drafts, committed, outcomes, strict=True)):
            row = host[at : at + len(outcome)]
            at += len(outcome)
            # Choices (greedy, seeded): accept while the draft matches them; sampled: (accepted, next token).
            compares = request.params.greedy or request.params.reproducible
            accepted, next_token = accept_greedy(tokens, row) if compares else (int(row[0]), int(row[1]))
            if index in further:  # every token but the last decoded is cached already: no sync, which rolls back
                state.tokens[length:] = [next_token, *further[index]]
            else:
                state.sync(length + accepted, [next_token])
            logprobs = scores.emitted(index, accepted + 1) if index in scores.rows else None
            results.append(VerifyResult(accepted=accepted, next_token=next_token, logprobs=logprobs,
                                        prompt_logprobs=prompts.get(index), more=further.get(index, ())))
        return results

    @staticmethod
    def _accept(request: VerifyRequest, logits: torch.Tensor, tokens: list[int], position: int) -> torch.Tensor:
        """On the device, for a sampled row (greedy rows are chosen together, in _score): the target's seeded choice
        at each of the k + 1 positions where the request is seeded (a drafted token stays iff the target's choice is
        the same token), or else [accepted, next token] by the min(1, p/q) rule. The first drafted token lands at
        sequence position `position`; random numbers are keyed by each token's position (core.sampling)."""
        params = request.params
        if params.reproducible:
            return gumbel_choice(processed_probs(logits, params), params.seed, position)
        seed = key_seed(params)
        probs = processed_probs(logits, params)
        k = len(tokens)
        resample = keyed_uniforms(seed, range(position, position + k + 1), SAMPLE_STREAM)
        if not tokens:
            pick = sample_index(probs, resample)
            return torch.cat([pick.new_zeros(1), pick])
        device, dist = probs.device, request.draft.dist
        accepted, next_token = accept_sampled(
            on_device([tokens], device, torch.long),
            SparseDist(on_device(dist.ids, device)[None], on_device(dist.probs, device)[None]),
            probs.unsqueeze(0),
            on_device(keyed_uniforms(seed, range(position, position + k), ACCEPT_STREAM).unsqueeze(0), device),
            on_device(resample.unsqueeze(0), device),
        )
        return torch.cat([accepted, next_token])


class _Logprobs:
    """The target's log-probabilities at every scored position of the rows that asked for them, brought to the host
    in one transfer on first use. Per position: [token emitted there, its logprob, top values..., top ids...]
    (ids travel as float64: exact for any vocabulary below 2**53)."""

    def __init__(self, rows: dict[int, tuple[int, int, int]], packed: torch.Tensor | None, width: int) -> None:
        self.rows = rows  # request index -> (its first packed position, its positions, top alternatives it asked)
        self._packed, self._width = packed, width
        self._host: list[list[float]] | None = None

    def emitted(self, index: int, count: int) -> list[TokenLogprob]:
        """The first `count` positions of request `index`: its accepted drafts, then the next token."""
        if self._host is None:
            self._host = self._packed.tolist() if self._packed is not None else []
        first, positions, top = self.rows[index]
        ids_at = 2 + self._width
        return [TokenLogprob(int(values[0]), values[1],
                             tuple((int(values[ids_at + j]), values[2 + j]) for j in range(top)))
                for values in self._host[first : first + min(count, positions)]]


def _score_logprobs(requests: list[VerifyRequest], row_logits: tuple[torch.Tensor, ...], drafts: list[list[int]],
                    outcomes: list[torch.Tensor]) -> _Logprobs:
    """On the device, for the rows whose requests ask for logprobs only (nothing at all when none does): log-softmax
    of the target's raw logits (float32; before temperature, top-k and top-p), batched over those rows' positions.
    Position i of a row scores the token emitted there if i drafts are accepted: the i-th drafted token for i below
    the accepted count, the next token at the accepted count."""
    asking = [i for i, request in enumerate(requests) if request.params.logprobs is not None]
    if not asking:
        return _Logprobs({}, None, 0)
    logits = torch.cat([row_logits[i] for i in asking]).float()
    width = min(max(requests[i].params.logprobs for i in asking), logits.shape[-1])
    tokens = torch.cat([_emitted_tokens(requests[i], drafts[i], outcomes[i]) for i in asking])
    log_probs = torch.log_softmax(logits, dim=-1)
    parts = [tokens.unsqueeze(1).double(), log_probs.gather(1, tokens.unsqueeze(1)).double()]
    if width:
        top = log_probs.topk(width, dim=-1)  # sorted: most likely first
        parts += [top.values.double(), top.indices.double()]
    rows, at = {}, 0
    for i in asking:
        rows[i] = (at, len(drafts[i]) + 1, min(requests[i].params.logprobs, width))
        at += len(drafts[i]) + 1
    return _Logprobs(rows, torch.cat(parts, dim=1), width)


def _emitted_tokens(request: VerifyRequest, drafts: list[int], outcome: torch.Tensor) -> torch.Tensor:
    """On the device: [k + 1] token ids, the one emitted at each position if the round stops there (see
    _score_logprobs); only positions up to the accepted count are ever read."""
    if request.params.greedy or request.params.reproducible:
        return outcome  # the target's choices: equal to the accepted drafts, then the next token
    accepted, next_token = outcome[0], outcome[1]
    drafted = on_device(drafts + [0], outcome.device, outcome.dtype)
    positions = torch.arange(len(drafts) + 1, device=outcome.device)
    return torch.where(positions < accepted, drafted, next_token)
