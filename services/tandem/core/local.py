"""In-process drafter and verifier over ModelRunners: the same roles the distributed workers play."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from tandem.core.costs import CATCH_UP_ALONE_ABOVE
from tandem.core.decode_steps import decode_more
from tandem.core.device import on_device
from tandem.core.logprobs import TokenLogprob
from tandem.core.penalties import draft_step_logits, verification_logits
from tandem.core.prompt_logprobs import split_prompt_rows
from tandem.core.protocol import (
    DraftDist,
    DraftProposal,
    DraftRequest,
    InProcessSide,
    KVUsage,
    StateLost,
    VerifyRequest,
    VerifyResult,
)
from tandem.core.rejection import accept_greedy, accept_sampled
from tandem.core.runner import ModelRunner
from tandem.core.sampling import (
    ACCEPT_STREAM,
    DRAFT_STREAM,
    SAMPLE_STREAM,
    SparseDist,
    greedy_tokens,
    gumbel_choice,
    keyed_uniforms,
    processed_probs,
    sample_index,
    truncate_top_m,
)
from tandem.core.sequence import SequenceState
from tandem.errors import RequestRefused

if TYPE_CHECKING:  # core.format_masks needs llguidance, which a runner alone (the GPU probe's) does without
    from tandem.core.format_masks import FormatMasks


def _key_seed(params) -> int:
    seed = params.key_seed
    if seed is None:
        raise ValueError("a sampled request needs a seed or an engine_seed (SpeculativeEngine.add_request sets one)")
    return seed


def _sync_all(runner: ModelRunner, requests: list) -> tuple[list[SequenceState], list[int]]:
    """Each request's state, synced; and for each, the tokens a sequence new to this runner found cached."""
    known = {r.seq_id: len(runner.states[r.seq_id].tokens) for r in requests if r.seq_id in runner.states}
    lost = [r.seq_id for r in requests if r.keep > known.get(r.seq_id, 0)]
    if lost:
        raise StateLost(lost)
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
        # Not a row whose prefill is capped this call: its decoding batch mates would wait for a whole prefix.
        if whole and request.seq_id not in known and not getattr(request, "prefill_limit", 0):
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


def _formatted(formats: FormatMasks | None, runner: ModelRunner, logits: torch.Tensor, wants: list[int],
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


class _ModelSide(InProcessSide):
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


class LocalDrafter(_ModelSide):
    """formats: the drafter's matchers for requests with a response format; without them such a request's drafts
    are proposed unconstrained (still exact: the verifier masks), and fewer of them are accepted."""

    def __init__(self, runner: ModelRunner, top_m: int = 64, confidence: float = 0.0,
                 formats: FormatMasks | None = None) -> None:
        super().__init__(runner, formats)
        self.top_m = top_m
        self.confidence = confidence

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        states, _ = _sync_all(self.runner, requests)
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
                logits = _formatted(self.formats, self.runner, logits, [1] * len(rows), step_requests, step_states,
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
        pick = sample_index(dist.probs, keyed_uniforms(_key_seed(params), [position], DRAFT_STREAM))
        return dist.ids[0, pick[0]], dist.probs[0, 0], dist


class LocalVerifier(_ModelSide):
    """formats: the verifier's matchers for requests with a response format (core.format_masks); a verifier without them
    refuses such requests."""

    def __init__(self, runner: ModelRunner, formats: FormatMasks | None = None) -> None:
        super().__init__(runner, formats)
        self.vocab_size = runner.vocab_size
        self.context_window = runner.context_window
        self.row_layout = runner.layout

    def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        states, reused = _sync_all(self.runner, requests)
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
        logits = _formatted(self.formats, self.runner, shaped, wants, requests, states, committed, drafts)
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
        seed = _key_seed(params)
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
