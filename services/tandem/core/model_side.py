"""What the in-process drafter and verifier share: a side over a ModelRunner, syncing its requests' states, and
their response formats' masks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tandem.core.protocol import InProcessSide, KVUsage, StateLost
from tandem.core.runner import ModelRunner
from tandem.core.sequence import SequenceState
from tandem.errors import RequestRefused

if TYPE_CHECKING:  # core.format_masks needs llguidance, which a runner alone (the GPU probe's) does without
    from tandem.core.format_masks import FormatMasks


def key_seed(params) -> int:
    seed = params.key_seed
    if seed is None:
        raise ValueError("a sampled request needs a seed or an engine_seed (SpeculativeEngine.add_request sets one)")
    return seed


def sync_all(runner: ModelRunner, requests: list) -> tuple[list[SequenceState], list[int]]:
    """Each request's state, synced; and for each, the tokens a sequence new to this runner found cached."""
    known = {r.seq_id: len(runner.states[r.seq_id].tokens) for r in requests if r.seq_id in runner.states}
    lost = [r.seq_id for r in requests if r.keep > known.get(r.seq_id, 0)]
    if lost:
        raise StateLost(lost)
    # A row whose prefill is capped may lead or copy a shared prefix only where every row's is (none is scored this
    # call, so none waits on the leader's forward of the whole prefix): else its batch mates would wait for it.
    all_capped = all(getattr(request, "prefill_limit", 0) for request in requests)
    states, fresh = [], []
    for index, request in enumerate(requests):
        # A new sequence (its whole history sent) may start from a prefix another holds; one whose prompt is
        # scored needs every prompt token in its scoring forward.
        whole = request.keep == 0 and not getattr(request, "score_prompt", False)
        state = runner.state(request.seq_id, request.session, request.append if whole else None, request.cache_scope)
        state.sync(request.keep, request.append)
        if state.cached >= len(state.tokens):
            # Scores come from feeding the last known token, so it must not be cached (happens on a retried call).
            state.truncate_cache(len(state.tokens) - 1)
        states.append(state)
        if whole and request.seq_id not in known and (all_capped or not getattr(request, "prefill_limit", 0)):
            fresh.append(index)
    # A row whose prompt is scored computes it all again (LocalVerifier.verify drops its cache): nothing reused.
    reused = [0 if r.seq_id in known or getattr(r, "score_prompt", False) else s.cached
              for r, s in zip(requests, states, strict=True)]
    # New sequences arriving together with a prefix nothing held had: one computes it (still counted uncached), the
    # others copy it.
    if len(fresh) > 1:
        for position in runner.share_among([states[i] for i in fresh]):
            reused[fresh[position]] = states[fresh[position]].cached
    runner.reused_tokens += sum(reused)
    return states, reused


def apply_formats(formats: FormatMasks | None, runner: ModelRunner, logits: torch.Tensor, wants: list[int],
               requests: list, states: list[SequenceState], committed: list[int], drafts: list[list[int]],
               ) -> torch.Tensor:
    """Logits with each request's response format applied (core.format_masks); the same tensor where none has one."""
    if not any(request.params.output_format for request in requests):
        return logits
    if formats is None:
        refused = next(request.seq_id for request in requests if request.params.output_format)
        raise RequestRefused(refused, "response_format: this worker was built without its tokenizer, so it cannot "
                             "follow a response format")
    if len(formats) > len(runner.states) + 32:
        formats.keep_only(runner.states.keys())
    return formats.apply(logits, wants, requests, states, committed, drafts)


class ModelSide(InProcessSide):
    """A side over a runner in this process; `formats` holds its requests' response-format matchers, if any."""

    def __init__(self, runner: ModelRunner, formats: FormatMasks | None) -> None:
        self.runner = runner
        self.formats = formats

    def release(self, seq_id: str, retain: bool = False) -> None:
        self.runner.release(seq_id, retain)
        if self.formats is not None:
            self.formats.release(seq_id)

    def kv_usage(self) -> KVUsage:
        return KVUsage.of(self.runner)
