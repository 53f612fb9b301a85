"""Log-probabilities of a prompt's own tokens, as the target gives them (vLLM's prompt_logprobs; what OpenAI's
completions report with `echo` and `logprobs`, and what evaluation harnesses score answers by).

Position i of a prompt holds the target's distribution over token i + 1, so a prompt of n tokens scores its tokens 1
to n - 1 (the first has nothing before it). The verifier gets those positions from the forward that scores the
sequence's first round: the prompt goes into that forward whole (not cached ahead, not reused from a session), and
the last hidden states at its n - 1 positions are kept beside the round's own and made into logits a few hundred
positions at a time, so a long prompt never holds all its logits at once. Values are the model's raw distribution
(log-softmax before penalties, temperature, top-k, top-p and any format), as for emitted tokens (core.logprobs).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tandem.core.device import on_device
from tandem.core.gc_pause import collector_paused
from tandem.core.logprobs import TokenLogprob
from tandem.core.protocol import VerifyRequest
from tandem.core.sequence import SequenceState

ROWS_AT_ONCE = 256  # positions whose logits exist at once: 256 x 152k float32, 156 MB, whatever the prompt's length

Logits = Callable[[torch.Tensor], torch.Tensor]  # last hidden states [N, H] -> logits [N, V] (ModelRunner.logits)


def score_prompt(hidden: torch.Tensor, logits: Logits, tokens: list[int], top: int) -> list[TokenLogprob]:
    """`hidden` [n - 1, H]: the last hidden states at a prompt's positions 0..n-2 (on the model's device); `tokens`
    the prompt's tokens 1..n-1; the logprob of each, its rank (vLLM reports it) and its `top` most likely
    alternatives, brought to the host at once. The logits are made and reduced ROWS_AT_ONCE positions at a time."""
    if not tokens:
        return []
    ids = on_device(tokens, hidden.device)
    width = 0
    parts = []
    for start in range(0, len(tokens), ROWS_AT_ONCE):
        log_probs = torch.log_softmax(logits(hidden[start : start + ROWS_AT_ONCE]).float(), dim=-1)
        width = min(top, log_probs.shape[-1])
        chosen = log_probs.gather(1, ids[start : start + ROWS_AT_ONCE, None])
        rank = (log_probs > chosen).sum(dim=-1, keepdim=True) + 1
        best = log_probs.topk(width, dim=-1) if width else None
        parts.append(torch.cat([chosen.double(), rank.double()]
                               + ([best.values.double(), best.indices.double()] if best else []), dim=1))
    # A long prompt's scores are many small objects (a tuple an alternative: 1M for 16 rows of 3000 x 20), enough to
    # set off a full collection that held the process, an in-process gateway's event loop with it, 0.28-0.36 s.
    with collector_paused():
        return _token_logprobs(tokens, torch.cat(parts).tolist(), width)


def _token_logprobs(tokens: list[int], host: list[list[float]], width: int) -> list[TokenLogprob]:
    return [TokenLogprob(token, row[0], tuple((int(row[2 + width + j]), row[2 + j]) for j in range(width)),
                         int(row[1]))
            for token, row in zip(tokens, host, strict=True)]


def split_prompt_rows(hidden: torch.Tensor, logits: Logits, wants: list[int], before: list[int],
                      requests: list[VerifyRequest], states: list[SequenceState],
                      ) -> tuple[torch.Tensor, dict[int, list[TokenLogprob]]]:
    """From the last hidden states of a forward in which some rows lead with `before` prompt positions: the
    verification's logits (`wants` rows a row, as a forward with the head gives them) and those rows' prompt
    logprobs by request index."""
    parts = hidden.split([w + b for w, b in zip(wants, before, strict=True)])
    prompts = {index: score_prompt(parts[index][:b], logits, state.tokens[1 : b + 1],
                                   request.params.prompt_logprobs or 0)
               for index, (request, state, b) in enumerate(zip(requests, states, before, strict=True))
               if request.score_prompt}
    return logits(torch.cat([part[b:] for part, b in zip(parts, before, strict=True)])), prompts
