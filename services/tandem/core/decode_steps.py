"""Multi-step decoding: a plain row decodes several tokens in one verifier call.

Plain decoding asks the host for every token: the engine commits it, plans the next step and calls the verifier
again, which copies the token in and launches the next forward. On a GPU the model idles through all of that (on an
H200 the target's 1-token forward took 2.27 ms and a decoded token 2.6 ms), and across a network every token pays a
round trip to a target worker. Here the verifier, after a call's first step, feeds each continuing row's choice
straight back into the next forward on the device and brings every step's tokens to the host in one transfer at the
end, as vLLM's multi-step scheduling did. The choices are the ones plain decoding makes step by step: greedy is the
argmax, and sampled rows draw with random numbers keyed by (seed, position) (core.sampling), so the tokens do not
depend on how many steps a call ran. The engine cuts a block at a stop or max_tokens like a speculative block, and
the next call's `keep` rolls the verifier back past the rest.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tandem.core.protocol import KVCacheFull, VerifyRequest
from tandem.core.runner import ModelRunner
from tandem.core.sampling import greedy_tokens
from tandem.core.sequence import SequenceState

# (request, logits [1, V] of one position, the position its token lands at) -> a device tensor ending in the token
Choose = Callable[[VerifyRequest, torch.Tensor, int], torch.Tensor]


def continues(request: VerifyRequest) -> bool:
    """Whether a row may decode past its first token in this call: a plain row (no draft) for which nothing between
    two tokens needs the host: no penalty or bias (they count the output so far, core.penalties), no response format
    (its masks follow each token on the host), no logprobs and no prompt scoring."""
    params = request.params
    return (request.steps > 1 and not (request.draft and request.draft.tokens) and not request.score_prompt
            and not params.reshapes_logits and params.output_format is None and params.logprobs is None)


def decode_more(runner: ModelRunner, requests: list[VerifyRequest], states: list[SequenceState],
                firsts: list[torch.Tensor], committed: list[int], choose: Choose) -> dict[int, torch.Tensor]:
    """After a call's first step, the rows that continue (by index) decode up to `steps - 1` more tokens each, every
    step's forward fed the step before's choices on the device. `firsts[i]`: row i's first outcome on the device,
    ending in its token, chosen at position committed[i]. Returns the further tokens of each row that decoded any,
    on the device. Each fed token is cached (`cached` moves on); the caller writes the tokens once they reach the
    host. A step the KV budget has no room for is not run (KVCacheFull comes before a forward writes anything): the
    rows keep what they decoded. On a CPU, where reading a choice waits for nothing, a row's block ends at one of its
    stop ids; on a GPU that would wait for every step, so a block runs on past a stop, and the engine drops the rest."""
    rows = [i for i, request in enumerate(requests) if continues(request)]
    last = {i: firsts[i][-1:] for i in rows}
    more: dict[int, list[torch.Tensor]] = {i: [] for i in rows}
    stops_seen = runner.device.type == "cpu"
    for step in range(1, max((requests[i].steps for i in rows), default=1)):
        rows = [i for i in rows if requests[i].steps > step
                and not (stops_seen and int(last[i]) in requests[i].stop_ids)]
        if not rows:
            break
        try:
            logits = runner.forward_fed([states[i] for i in rows], torch.cat([last[i] for i in rows]))
        except KVCacheFull:
            break
        greedy = greedy_tokens(logits) if any(requests[i].params.greedy for i in rows) else None
        for at, i in enumerate(rows):
            request = requests[i]
            token = (greedy[at : at + 1] if request.params.greedy
                     else choose(request, logits[at : at + 1], committed[i] + step)[-1:])
            more[i].append(token)
            last[i] = token
    return {i: torch.cat(tokens) for i, tokens in more.items() if tokens}
