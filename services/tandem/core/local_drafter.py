"""The in-process drafter: proposes each row's draft tokens over a ModelRunner, with the distributions the verifier
accepts them by."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tandem.core.costs import CATCH_UP_ALONE_ABOVE
from tandem.core.model_side import ModelSide, apply_formats, key_seed, sync_all
from tandem.core.penalties import draft_step_logits
from tandem.core.protocol import DraftDist, DraftProposal, DraftRequest
from tandem.core.runner import ModelRunner
from tandem.core.sampling import (
    DRAFT_STREAM,
    SparseDist,
    greedy_tokens,
    gumbel_choice,
    keyed_uniforms,
    processed_probs,
    sample_index,
    truncate_top_m,
)

if TYPE_CHECKING:  # core.format_masks needs llguidance, which a runner alone (the GPU probe's) does without
    from tandem.core.format_masks import FormatMasks


class LocalDrafter(ModelSide):
    """formats: the drafter's matchers for requests with a response format; without them such a request's drafts
    are proposed unconstrained (still exact: the verifier masks), and fewer of them are accepted."""

    def __init__(self, runner: ModelRunner, top_m: int = 64, confidence: float = 0.0,
                 formats: FormatMasks | None = None) -> None:
        super().__init__(runner, formats)
        self.top_m = top_m
        self.confidence = confidence

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        states, _ = sync_all(self.runner, requests)
        # Catch-ups (prompts, tokens decoded while not drafting, rows that only catch up: k 0) run before the
        # drafting, batched among themselves, so the draft steps' rows stay one or two tokens wide. A row that only
        # catches up on a token or two (a rider) is fed in the first draft step instead, its logits not computed.
        drafting = any(r.k > 0 for r in requests)
        riders = [drafting and r.k == 0 and len(s.pending) <= CATCH_UP_ALONE_ABOVE
                  for s, r in zip(states, requests, strict=True)]
        behind = [s for s, r, rider in zip(states, requests, riders, strict=True) if not rider and (
            r.k == 0 or (len(states) > 1 and len(s.pending) > CATCH_UP_ALONE_ABOVE))]
        self.runner.prefill_many(behind, [len(s.tokens) - 1 for s in behind])
        proposals = [DraftProposal(tokens=[]) for _ in requests]
        dists: list[list[SparseDist]] = [[] for _ in requests]
        budget = [r.k for r in requests]
        for step in range(max(budget, default=0)):
            rows = [i for i, k in enumerate(budget) if k > step]
            if not rows:
                break
            fed = rows if step else sorted(rows + [i for i, rider in enumerate(riders) if rider])
            wants = [int(i in rows) for i in fed]
            step_requests, step_states = [requests[i] for i in rows], [states[i] for i in rows]
            logits = draft_step_logits(self.runner.forward_on_device([states[i] for i in fed], wants),
                                       step_requests, step_states)
            if self.formats is not None:
                logits = apply_formats(self.formats, self.runner, logits, [1] * len(rows), step_requests, step_states,
                                    [len(state.tokens) for state in step_states], [[] for _ in rows])
            picked, step_dists = self._choose(logits, [requests[i] for i in rows],
                                              [len(states[i].tokens) for i in rows])
            for i, (token, _), dist in zip(rows, picked, step_dists, strict=True):
                states[i].tokens.append(int(token))
                proposals[i].tokens.append(int(token))
                if dist is not None:
                    dists[i].append(dist)
            self._stop_unsure(rows, [top for _, top in picked], budget, step)
        for proposal, row_dists in zip(proposals, dists, strict=True):
            if row_dists:  # to the host in one transfer per proposal: it may travel to a verifier elsewhere
                ids = torch.cat([d.ids for d in row_dists])
                # ids ride as float64 beside the probabilities: exact for any vocabulary below 2**53
                host = torch.cat([ids.double(), torch.cat([d.probs for d in row_dists]).double()], dim=1).cpu()
                proposal.dist = DraftDist(host[:, : ids.shape[1]].long().numpy(),
                                          host[:, ids.shape[1] :].to(row_dists[0].probs.dtype).numpy())
        return proposals

    def _stop_unsure(self, rows: list[int], tops: list[float], budget: list[int], step: int) -> None:
        """Confidence stops: a row whose draft's top probability fell below `confidence` drafts no further than the
        rows still sure of theirs (none: it stops here). A draft step costs about as much over one row as over all
        of them, and the batch's verification pads every row to the widest block, so an unsure row that keeps pace
        with sure ones costs next to nothing, and its drafts may still be accepted; alone, it would pay a step and a
        wider verification for a draft likely rejected."""
        sure = [budget[i] for i, top in zip(rows, tops, strict=True) if top >= self.confidence]
        reach = max(sure, default=step + 1)
        for i, top in zip(rows, tops, strict=True):
            if top < self.confidence:
                budget[i] = min(budget[i], reach)

    def _choose(self, logits: torch.Tensor, requests: list[DraftRequest], positions: list[int]
                ) -> tuple[list[list[float]], list[SparseDist | None]]:
        """A draft step's [token, the draft's top probability] per row, brought to the host in one transfer, and each
        row's distribution (_sample). Greedy rows, the common case, are chosen together: one reduction over the
        step's logits rather than one per row."""
        if all(request.params.greedy for request in requests):
            top = self._top_probabilities(logits)
            return torch.stack([greedy_tokens(logits).double(), top.double()], dim=1).tolist(), [None] * len(requests)
        choices = [self._sample(logits[n : n + 1], request, position)
                   for n, (request, position) in enumerate(zip(requests, positions, strict=True))]
        picked = torch.stack([torch.stack([token.double(), top.double()]) for token, top, _ in choices]).tolist()
        return picked, [dist for _, _, dist in choices]

    def _top_probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's largest draft probability, which the confidence stop reads (ones where the stop is off)."""
        return logits.float().softmax(-1).amax(-1) if self.confidence else logits.new_ones(logits.shape[0])

    def _sample(self, logits: torch.Tensor, request: DraftRequest,
                position: int) -> tuple[torch.Tensor, torch.Tensor, SparseDist | None]:
        """On the device: (token for sequence position `position`, the draft's top probability, the distribution
        it was drawn from or None where verification compares choices (greedy, seeded))."""
        params = request.params
        if params.greedy:
            return greedy_tokens(logits)[0], self._top_probabilities(logits)[0], None
        if params.reproducible:
            probs = processed_probs(logits, params)
            return gumbel_choice(probs, params.seed, position)[0], probs.max(), None
        dist = truncate_top_m(processed_probs(logits, params), self.top_m)
        pick = sample_index(dist.probs, keyed_uniforms(key_seed(params), [position], DRAFT_STREAM))
        return dist.ids[0, pick[0]], dist.probs[0, 0], dist
