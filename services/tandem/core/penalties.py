"""Penalties and logit bias: how a request reshapes a model's logits by the context so far, on the model's device,
for draft and target alike, before temperature, top-k and top-p (core.sampling).

In the order vLLM applies them (and with the meaning OpenAI's fields have): the ids that would end the output are
held back (-inf) at positions before min_tokens of output; the bias is added to the raw logits;
then the repetition penalty (CTRL's, as Hugging Face's RepetitionPenaltyLogitsProcessor) divides the positive logit
and multiplies the negative one of every token found anywhere in the context, prompt included; then the frequency
and presence penalties subtract from the logit of each token the output holds, per occurrence and once.

A position's logits so depend on every token before it. A verification scores k + 1 positions at once: position i
counts the context plus the first i drafted tokens, exactly what plain decoding would have counted there, so the
distribution each position is verified against is the one plain decoding samples from and speculation stays
lossless. The draft reshapes its own logits the same way, so its proposals follow what the target will accept.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.core.config import SamplingParams
from tandem.core.device import on_device
from tandem.core.protocol import DraftRequest, VerifyRequest
from tandem.core.sequence import SequenceState


def reshaped_logits(logits: torch.Tensor, params: SamplingParams, context: Sequence[int], output_start: int,
                    drafts: Sequence[int] = ()) -> torch.Tensor:
    """[w, V] logits of w consecutive positions -> a new [w, V] float32 tensor with params' bias and penalties
    applied (reshape_)."""
    return reshape_(logits.to(torch.float32, copy=True), params, context, output_start, drafts)


def reshape_(logits: torch.Tensor, params: SamplingParams, context: Sequence[int], output_start: int,
             drafts: Sequence[int] = ()) -> torch.Tensor:
    """Apply params' bias and penalties in place to [w, V] float32 logits of w consecutive positions, and return
    them. Position 0 follows `context` (whose output begins at `output_start`); position i follows `context` then
    drafts[:i]. Token ids at or past V (a draft scoring part of the vocabulary) are left out. The penalties touch
    only the columns of tokens the context and drafts hold, a few hundred of a vocabulary's 150k: over the whole
    vocabulary one verification of 5 positions took 2.7 ms on a 2-core CPU."""
    width, vocab = logits.shape
    device = logits.device
    if params.holds_back_ends:
        # Position i emits the output's token number len(context) - output_start + i (from 0).
        held = params.min_tokens - (len(context) - output_start)
        ends = [token for token in params.end_ids if token < vocab]
        if held > 0 and ends:
            logits[:held, on_device(ends, device, torch.long)] = float("-inf")
    if params.logit_bias:
        biased = [(token, bias) for token, bias in params.logit_bias if token < vocab]
        if biased:
            ids = on_device([token for token, _ in biased], device, torch.long)
            logits[:, ids] += on_device([bias for _, bias in biased], device, torch.float32)
    penalize_repeats = params.repetition_penalty != 1.0
    penalize_output = params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
    if not (penalize_repeats or penalize_output):
        return logits
    drafts = list(drafts[: width - 1])
    tokens = on_device(list(context) + drafts, device, torch.long)
    kept = tokens < vocab
    # Columns: the distinct ids the context and drafts hold; `column` maps each token to its own.
    columns, column = torch.unique(torch.where(kept, tokens, 0), return_inverse=True)
    distinct = len(columns)
    ones = kept.to(torch.float32)  # an id past V counts nowhere
    length = len(context)
    drafted = torch.zeros(width, distinct, dtype=torch.float32, device=device)  # row i: drafts[:i]
    if drafts:
        pairs = [(row, length + j) for j in range(len(drafts)) for row in range(j + 1, width)]
        rows = on_device([row for row, _ in pairs], device, torch.long)
        at = on_device([index for _, index in pairs], device, torch.long)
        drafted.index_put_((rows, column[at]), ones[at], accumulate=True)
    scores = logits[:, columns]
    if penalize_repeats:
        in_context = torch.zeros(distinct, dtype=torch.float32, device=device).index_add_(0, column[:length],
                                                                                         ones[:length])
        seen = (in_context > 0).unsqueeze(0) | (drafted > 0)
        penalty = params.repetition_penalty
        scores = torch.where(seen, torch.where(scores > 0, scores / penalty, scores * penalty), scores)
    if penalize_output:
        counts = torch.zeros(distinct, dtype=torch.float32, device=device).index_add_(
            0, column[output_start:length], ones[output_start:length]).unsqueeze(0) + drafted
        scores = scores - (params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float())
    logits[:, columns] = scores
    return logits


def draft_step_logits(logits: torch.Tensor, requests: list[DraftRequest], states: list[SequenceState]) -> torch.Tensor:
    """A draft step's logits (one row per request) with each request's penalties and bias applied: a verification's
    rows one position wide, each state's tokens (which already end with the row's drafts so far) its context."""
    return verification_logits(logits, [1] * len(requests), requests, states, [len(state.tokens) for state in states],
                               [[] for _ in requests])


def verification_logits(logits: torch.Tensor, wants: list[int], requests: list[VerifyRequest | DraftRequest],
                        states: list[SequenceState], committed: list[int], drafts: list[list[int]]) -> torch.Tensor:
    """A verification's logits (`wants` positions a row) with each request's penalties and bias applied, position i
    of a row counting its context (its state's first `committed` tokens) and first i drafts; the same tensor where
    no request has any."""
    if not any(request.params.reshapes_logits for request in requests):
        return logits
    logits = logits.to(torch.float32, copy=True)
    at = 0
    for request, state, length, tokens, width in zip(requests, states, committed, drafts, wants, strict=True):
        if request.params.reshapes_logits:
            reshape_(logits[at : at + width], request.params, state.tokens[:length], request.output_start, tokens)
        at += width
    return logits
