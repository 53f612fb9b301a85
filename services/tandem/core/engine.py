"""The speculative engine: requests in, one round per step, tokens out.

A round: the round plan (core.round_plan) decides each sequence's k, the drafter proposes, the verifier scores all
k + 1 positions in one forward and accepts a prefix, and stops cut the block; the sessions' policies then record the
round (core.round_stages runs its stages). The drafter and verifier are protocols, so the same loop drives in-process
models and remote workers. A prompt that arrives while others decode is prefilled in chunks, one per step, and joins
the rounds once the rest of it fits in one (EngineConfig.prefill_chunk). Which sequences a step runs, and which gives
its caches up when the verifier's KV cache cannot hold them all (KVCacheFull), core.scheduler decides: one that gives
them up waits in the queue, its workers drop its caches, and it is sent its whole history again when it resumes (same
tokens: greedy choices and seeded random numbers depend only on the context).
"""

from __future__ import annotations

import dataclasses
import itertools
import secrets
from collections.abc import Callable, Iterator

from tandem.core import policy
from tandem.core.calibration import calibrate, kv_tokens_needed
from tandem.core.config import EngineConfig, SamplingParams
from tandem.core.costs import CostModel
from tandem.core.prediction import Prediction, predicted_acceptance, predicted_proposal
from tandem.core.prompt_lookup import LookupAcceptance, Pace, PromptLookup
from tandem.core.protocol import Drafter, KVCacheFull, Verifier
from tandem.core.requests import GenerationResult, Sequence, StepOutput
from tandem.core.round_plan import RoundPlan, RowView, plan_round
from tandem.core.round_stages import commit_block, draft_batch, verify_batch
from tandem.core.scheduler import Scheduler
from tandem.core.stops import FINISH_ABORT, StopChecker
from tandem.errors import InvalidArgument, check_in_vocabulary, request_id_in_use


class SpeculativeEngine:
    def __init__(
        self,
        verifier: Verifier,
        drafter: Drafter | None = None,
        config: EngineConfig | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
        decode: Callable[[list[int]], str] | None = None,
        costs: CostModel | None = None,
        prior: policy.SharedPrior | None = None,
    ) -> None:
        """`costs` and `prior` may be shared with other engines over the same workers (gateway.lanes)."""
        self.verifier, self.drafter = verifier, drafter
        self.config = config or EngineConfig()
        self.eos_token_ids, self.decode = eos_token_ids, decode
        self.costs = costs or CostModel()
        self.costs.layout = verifier.row_layout  # the batch plan prices a round as the target lays out its rows
        self.prior = prior or policy.SharedPrior(self.config.spec.acceptance_prior)
        self.lookup_acceptance = LookupAcceptance()  # looked-up drafts' acceptance by match length (prompt lookup)
        self.sequences: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.scheduler = Scheduler(self.config.max_batch, self._drop_caches)
        # Tokens the running step's target forward computes at most (its rows' uncached context, drafts): what a
        # step may take grows with them (the gateway's stall watchdog). Read from another thread.
        self.step_tokens = 0
        if self.config.calibrates(self.drafter is not None):
            self.calibrate()

    @property
    def speculating(self) -> bool:
        return self.drafter is not None and self.config.spec.speculating

    def add_request(self, prompt: list[int], params: SamplingParams, request_id: str | None = None,
                    policy_state: policy.PolicyState | None = None, max_k: int | None = None,
                    session_id: str = "", cache_scope: str = "", priority: int = 0,
                    prediction: list[int] | None = None) -> str:
        """`cache_scope`: the requests that may share cached prompt prefixes with this one (a tenant's); `priority`:
        lower runs first (module docstring); `prediction`: the tokens the output is expected to repeat, drafted where
        it does (core.prediction)."""
        if not prompt:
            raise InvalidArgument("prompt: must contain at least one token")
        vocab = self.verifier.vocab_size
        check_in_vocabulary("prompt", prompt, vocab)
        check_in_vocabulary("logit_bias", (t for t, _ in params.logit_bias), vocab)
        check_in_vocabulary("stop_token_ids", params.stop_token_ids, vocab)  # a stop the model can never produce
        check_in_vocabulary("prediction", prediction or (), vocab)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.sequences:
            raise request_id_in_use(request_id)
        if max_k is not None and max_k < 0:
            raise InvalidArgument(f"max_k: must be non-negative, got {max_k}")
        if not params.greedy and params.key_seed is None:
            # One seed for every worker and tensor-parallel rank: their random numbers agree, and a worker that
            # lost its state redraws the same numbers for the same positions rather than reusing earlier ones.
            params = dataclasses.replace(params, engine_seed=secrets.randbits(63))
        state = policy_state or policy.PolicyState(k=self.config.spec.k_init)
        stop = StopChecker(params, self.eos_token_ids, self.decode)
        if params.min_tokens:  # the ids min_tokens holds back are the ones that would end the output
            params = dataclasses.replace(params, end_ids=tuple(sorted(stop.stop_ids)))
        looks_up = self.config.spec.prompt_lookup and not prediction
        self.sequences[request_id] = Sequence(request_id, list(prompt), params, stop, state, max_k=max_k,
                                              session_id=session_id, cache_scope=cache_scope, priority=priority,
                                              logprobs=None if params.logprobs is None else [],
                                              prediction=Prediction(prediction) if prediction else None,
                                              lookup=PromptLookup(prompt) if looks_up else None,
                                              pace=Pace() if looks_up else None)
        return request_id

    def abort(self, request_id: str) -> None:
        seq = self.sequences.get(request_id)
        if seq is not None:
            seq.finish_reason = FINISH_ABORT
            self._release(seq)

    def has_unfinished(self) -> bool:
        return bool(self.sequences)

    def sequence(self, request_id: str) -> Sequence:
        return self.sequences[request_id]

    @property
    def max_batch(self) -> int:
        return self.config.max_batch

    @property
    def preemptions(self) -> dict[str, int]:
        """Sequences taken out of the steps they ran in, by why (core.scheduler)."""
        return self.scheduler.preemptions

    def step(self) -> list[StepOutput]:
        batch, waiting = self.scheduler.schedule(self.sequences.values())
        while True:
            limits = self._prefill_limits(batch)
            self.step_tokens = sum(_step_tokens(seq, limit) for seq, limit in zip(batch, limits, strict=True)) \
                + len(batch) * self.config.spec.k_max
            offers = [seq.offer(self.config.spec.k_max) for seq in batch]
            plan = plan_round([self._row_view(seq, limit, len(offer))
                               for seq, limit, offer in zip(batch, limits, offers, strict=True)],
                              self.speculating, self.config.spec, self.costs, self.prior.value, self.prior.measured,
                              self.config.max_prefill_tokens)
            try:
                outputs = self._round(batch, plan, limits, offers)
                break
            except KVCacheFull as full:
                batch = self.scheduler.make_room(batch, waiting, full)
                if not batch:  # others' sequences ahead of its one row fill the workers: wait for them to finish
                    self.scheduler.wait()
                    return []
        self.scheduler.ran(batch, waiting)
        # A sequence whose prefill is still going on was only prefilling a chunk: it has nothing to report yet.
        return [out for out in outputs if out is not None]

    def _drop_caches(self, seq: Sequence) -> None:
        retain = bool(seq.session_id)
        self.verifier.release(seq.request_id, retain)
        if self.drafter is not None:
            self.drafter.release(seq.request_id, retain)
        seq.verify_synced = seq.draft_synced = 0
        seq.prefill_started = False

    def _prefill_limits(self, batch: list[Sequence]) -> list[int]:
        """Per sequence, the most uncached tokens its verifier may prefill this step (0: all). While another sequence
        waits on this step for its next token (one decoding, or a new prompt prefilled whole), a longer prompt is cut
        into chunks of prefill_chunk; with none waiting, a prompt longer than max_prefill_tokens into chunks of that
        many, so steps end often enough for arrivals and aborts. A prompt whose tokens are scored goes in whole.
        Another caller's sequences on the target worker a prompt runs on (a shared pool's other gateways) wait on
        its forwards as this engine's own would: the prompt is cut as if they decoded here."""
        chunk, most = self.config.prefill_chunk, self.config.max_prefill_tokens
        long = [most > 0 and seq.prefilling(most) and not seq.scores_prompt for seq in batch]
        decoding = any(seq.output for seq in batch)
        waiting = decoding or any(not seq.output and not is_long for seq, is_long in zip(batch, long, strict=True))
        limits = []
        for seq, is_long in zip(batch, long, strict=True):
            cut = chunk and seq.prefilling(chunk) and not seq.scores_prompt
            if cut and ((waiting and (decoding or is_long)) or self.verifier.others_running(seq.request_id) > 0):
                limits.append(chunk)
            else:
                limits.append(most if is_long else 0)
        return limits

    def _row_view(self, seq: Sequence, prefill_limit: int, predicted: int) -> RowView:
        return RowView(seq.policy, seq.max_k, seq.params.max_tokens - len(seq.output), prefill_limit,
                       first_round=not seq.output, behind=len(seq.context) - seq.draft_synced,
                       predicting=seq.prediction is not None, predicted=predicted,
                       prediction_acceptance=predicted_acceptance(seq.stats.prediction_accepted,
                                                                  seq.stats.prediction_rejected)
                       if seq.prediction is not None or seq.lookup is None
                       else self.lookup_acceptance.value(seq.lookup.matched),
                       pace=seq.pace.rate if seq.pace is not None else 0.0)

    def _round(self, batch: list[Sequence], plan: RoundPlan, limits: list[int],
               offers: list[list[int]]) -> list[StepOutput | None]:
        """Draft, verify, commit. A KVCacheFull from the verifier commits nothing and moves no policy: the caller
        plans the round again for a smaller batch."""
        proposals = draft_batch(self.drafter, self.costs, batch, plan)
        for i, seq in enumerate(batch):  # the rows that draft their predictions or look-ups (round_plan rule 0)
            if plan.from_prediction(i):
                proposals[i] = predicted_proposal(offers[i][: plan.ks[i]], sampled=not seq.params.greedy)
        ks = [len(p.tokens) if p else 0 for p in proposals]  # drafted: a confidence stop or a failure drafts fewer
        results = verify_batch(self.verifier, self.costs, self.config.decode_steps, batch, proposals, ks, limits)
        for seq, decision in zip(batch, plan.decisions, strict=True):
            if decision is not None:
                policy.apply(seq.policy, decision)
        outputs: list[StepOutput | None] = []
        for i, (seq, k, proposal, result) in enumerate(zip(batch, ks, proposals, results, strict=True)):
            if result.cached_prompt and not seq.output:  # new to the verifier: what of its prompt it found cached
                seq.stats.cached_prompt_tokens = min(result.cached_prompt, len(seq.prompt))
            if result.prefilling:
                seq.verify_synced = len(seq.context)  # the verifier holds the whole prompt, part of it cached
                seq.prefill_started = True
                outputs.append(None)
            else:
                if k and plan.from_prediction(i) and seq.prediction is None:  # looked up: what its class accepts
                    self.lookup_acceptance.observe(seq.lookup.matched, k, result.accepted)
                outputs.append(commit_block(seq, k, proposal, result, plan.from_prediction(i), self.costs,
                                            self.config.spec, self.prior, self._release))
        return outputs

    def _release(self, seq: Sequence) -> None:
        self.sequences.pop(seq.request_id, None)
        self._kv_full = False
        retain = bool(seq.session_id) and seq.finish_reason != FINISH_ABORT
        self.verifier.release(seq.request_id, retain)
        if self.drafter is not None:
            self.drafter.release(seq.request_id, retain)

    def session_affinity(self, session_id: str) -> dict[str, str]:
        """The names of the draft worker and target replica that retained the session's cache (none in-process)."""
        found = {}
        for key, side in (("draft_worker", self.drafter), ("target_replica", self.verifier)):
            worker = side.session_worker(session_id) if side is not None else None
            if worker is not None:
                found[key] = worker
        return found

    def pin_session(self, session_id: str, affinity: dict) -> None:
        """Route the session's next sequence as `affinity` (from session_affinity, e.g. via a session store) says.
        Workers are named; a worker that is gone is skipped (the session is placed afresh)."""
        for key, side in (("draft_worker", self.drafter), ("target_replica", self.verifier)):
            if side is not None and isinstance(affinity.get(key), str):
                side.pin_session(session_id, affinity[key])

    def result(self, seq: Sequence) -> GenerationResult:
        text = None
        if self.decode is not None:
            text = self.decode(seq.output)
            if seq.text_cut is not None:
                text = text[: seq.text_cut]
        stats = seq.stats.report(seq.policy.fallback, seq.policy.k)
        return GenerationResult(seq.request_id, list(seq.output), text, seq.finish_reason or FINISH_ABORT, stats,
                                None if seq.logprobs is None else list(seq.logprobs), seq.prompt_logprobs)

    def stream(self, prompt: list[int], params: SamplingParams) -> Iterator[StepOutput]:
        request_id = self.add_request(prompt, params)
        while request_id in self.sequences:
            yield from (out for out in self.step() if out.request_id == request_id)

    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams]) -> list[GenerationResult]:
        all_params = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.sequences[self.add_request(p, sp)] for p, sp in zip(prompts, all_params, strict=True)]
        while self.sequences:
            self.step()
        return [self.result(seq) for seq in seqs]

    def calibrate(self) -> CostModel:
        """Time the forwards rounds are made of (core.calibration) and seed the cost model with them."""
        spec = self.config.spec
        try:
            measured = calibrate(self.verifier, self.drafter, spec.k_max, spec.k_init, self.config.max_batch)
        except KVCacheFull as full:
            rows = self.config.max_batch
            held, remedy = (("the sequence", "raise --kv-tokens") if rows == 1 else
                            (f"the {rows} sequences", "raise --kv-tokens or lower --max-batch"))
            needed = kv_tokens_needed(spec.k_max, rows)
            raise InvalidArgument(f"kv_tokens: a KV budget of {full.capacity} tokens cannot hold {held} calibration "
                                  f"times (it needs {needed}); {remedy}") from full
        self.costs.adopt(measured)
        return self.costs


def _step_tokens(seq: Sequence, prefill_limit: int) -> int:
    """At most how many tokens of `seq`'s context a step's target forward computes besides drafts: what the verifier
    lacks (or a prefill chunk of it)."""
    lacking = len(seq.context) - seq.verify_synced
    return min(lacking, prefill_limit) if prefill_limit else lacking
