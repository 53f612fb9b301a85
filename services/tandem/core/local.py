"""In-process drafter and verifier over ModelRunners: the same roles the distributed workers play."""

from __future__ import annotations

import torch

from tandem.core.costs import CATCH_UP_ALONE_ABOVE
from tandem.core.protocol import (
    PREFILLING,
    DraftProposal,
    DraftRequest,
    StateLost,
    VerifyRequest,
    VerifyResult,
)
from tandem.core.rejection import accept_greedy, accept_sampled
from tandem.core.runner import ModelRunner, SequenceState
from tandem.core.sampling import (
    ACCEPT_STREAM,
    DRAFT_STREAM,
    SAMPLE_STREAM,
    SparseDist,
    gumbel_choice,
    keyed_uniforms,
    processed_probs,
    sample_index,
    truncate_top_m,
)


def _key_seed(params) -> int:
    seed = params.key_seed
    if seed is None:
        raise ValueError("a sampled request needs a seed or an engine_seed (SpeculativeEngine.add_request sets one)")
    return seed


def _sync_all(runner: ModelRunner, requests: list) -> list[SequenceState]:
    known = {r.seq_id: len(runner.states[r.seq_id].tokens) for r in requests if r.seq_id in runner.states}
    lost = [r.seq_id for r in requests if r.keep > known.get(r.seq_id, 0)]
    if lost:
        raise StateLost(lost)
    states = []
    for request in requests:
        state = runner.state(request.seq_id, request.session)
        state.sync(request.keep, request.append)
        if request.seq_id not in known:
            runner.reused_tokens += min(state.cached, len(state.tokens) - 1)
        if state.cached >= len(state.tokens):
            # Scores come from feeding the last known token, so it must not be cached (happens on a retried call).
            state.truncate_cache(len(state.tokens) - 1)
        states.append(state)
    return states


class LocalDrafter:
    def __init__(self, runner: ModelRunner, top_m: int = 64, confidence: float = 0.0) -> None:
        self.runner = runner
        self.top_m = top_m
        self.confidence = confidence

    def release(self, seq_id: str, retain: bool = False) -> None:
        self.runner.release(seq_id, retain)

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        states = _sync_all(self.runner, requests)
        if len(states) > 1:
            # Long catch-ups (prompts, tokens decoded while not drafting) run alone so batched rows stay short.
            for state in states:
                if len(state.pending) > CATCH_UP_ALONE_ABOVE:
                    self.runner.prefill(state, len(state.tokens) - 1)
        proposals = [DraftProposal(tokens=[]) for _ in requests]
        dists: list[list[SparseDist]] = [[] for _ in requests]
        budget = [r.k for r in requests]
        for step in range(max(budget, default=0)):
            rows = [i for i, k in enumerate(budget) if k > step]
            if not rows:
                break
            logits = self.runner.forward([states[i] for i in rows], [1] * len(rows))
            for i, row_logits in zip(rows, logits, strict=True):
                token, dist, confidence = self._sample(row_logits, requests[i], len(states[i].tokens))
                states[i].tokens.append(token)
                proposals[i].tokens.append(token)
                if dist is not None:
                    dists[i].append(dist)
                if confidence < self.confidence:
                    budget[i] = step + 1
        for proposal, row_dists in zip(proposals, dists, strict=True):
            if row_dists:
                proposal.dist = SparseDist(torch.cat([d.ids for d in row_dists]),
                                           torch.cat([d.probs for d in row_dists]))
        return proposals

    def _sample(self, logits: torch.Tensor, request: DraftRequest,
                position: int) -> tuple[int, SparseDist | None, float]:
        """(token for sequence position `position`, the distribution it was drawn from or None where verification
        compares choices (greedy, seeded), the draft's top probability)."""
        params = request.params
        if params.greedy:
            top = logits[-1].softmax(-1).max() if self.confidence else torch.tensor(1.0)
            return int(logits[-1].argmax()), None, float(top)
        if params.reproducible:
            probs = processed_probs(logits[-1:], params)
            return int(gumbel_choice(probs, params.seed, position)[0]), None, float(probs.max())
        dist = truncate_top_m(processed_probs(logits[-1:], params), self.top_m)
        pick = sample_index(dist.probs, keyed_uniforms(_key_seed(params), [position], DRAFT_STREAM))
        return int(dist.ids[0, pick[0]]), dist, float(dist.probs[0, 0])


class LocalVerifier:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.vocab_size = runner.vocab_size

    def release(self, seq_id: str, retain: bool = False) -> None:
        self.runner.release(seq_id, retain)

    def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        states = _sync_all(self.runner, requests)
        results: list[VerifyResult] = [VerifyResult(0, PREFILLING)] * len(requests)
        scoring = []
        for index, (request, state) in enumerate(zip(requests, states, strict=True)):
            uncached = len(state.pending) - 1  # everything but the last token is cached before scoring
            if 0 < request.prefill_limit < uncached:
                self.runner.prefill(state, state.cached + request.prefill_limit)
                continue
            if uncached > 0:
                self.runner.prefill(state, len(state.tokens) - 1)
            scoring.append(index)
        if scoring:
            for index, result in zip(scoring, self._score([requests[i] for i in scoring], [states[i] for i in scoring]),
                                     strict=True):
                results[index] = result
        return results

    def _score(self, requests: list[VerifyRequest], states: list[SequenceState]) -> list[VerifyResult]:
        drafts = [r.draft.tokens if r.draft else [] for r in requests]
        committed = [len(state.tokens) for state in states]
        for state, tokens in zip(states, drafts, strict=True):
            state.tokens.extend(tokens)
        logits = self.runner.forward(states, [len(tokens) + 1 for tokens in drafts])
        results = []
        for request, state, row_logits, tokens, length in zip(requests, states, logits, drafts, committed, strict=True):
            accepted, next_token = self._accept(request, row_logits, tokens, length)
            state.sync(length + accepted, [next_token])
            results.append(VerifyResult(accepted=accepted, next_token=next_token))
        return results

    @staticmethod
    def _accept(request: VerifyRequest, logits: torch.Tensor, tokens: list[int], position: int) -> tuple[int, int]:
        """Accept a prefix of the drafted `tokens` (the first lands at sequence position `position`) and choose the
        next token. Random numbers are keyed by each token's position (core.sampling)."""
        params = request.params
        drafted = torch.tensor(tokens, dtype=torch.long)
        if params.greedy:
            return accept_greedy(drafted, logits.argmax(dim=-1))
        if params.reproducible:  # a drafted token stays iff the target's seeded choice is the same token
            return accept_greedy(drafted, gumbel_choice(processed_probs(logits, params), params.seed, position))
        seed = _key_seed(params)
        probs = processed_probs(logits, params)
        k = len(tokens)
        resample = keyed_uniforms(seed, range(position, position + k + 1), SAMPLE_STREAM)
        if not tokens:
            return 0, int(sample_index(probs, resample)[0])
        dist = request.draft.dist
        accepted, next_token = accept_sampled(
            drafted.unsqueeze(0),
            SparseDist(dist.ids.unsqueeze(0), dist.probs.unsqueeze(0)),
            probs.unsqueeze(0),
            keyed_uniforms(seed, range(position, position + k), ACCEPT_STREAM).unsqueeze(0),
            resample.unsqueeze(0),
        )
        return int(accepted[0]), int(next_token[0])
