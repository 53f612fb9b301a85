"""The stages of one round over a batch (core.engine drives them): drafting, verifying, and committing a verified
block to its sequence. Each is a function of the engine's parts it needs, so the engine keeps only the order they run
in. A worker that lost a sequence's state (StateLost) is sent its whole history and asked once more.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from tandem.core import policy
from tandem.core.config import SpecConfig
from tandem.core.costs import CostModel
from tandem.core.protocol import (
    Drafter,
    DraftProposal,
    DraftRequest,
    KVCacheFull,
    StateLost,
    Verifier,
    VerifyRequest,
    VerifyResult,
)
from tandem.core.requests import Sequence, StepOutput
from tandem.core.round_plan import RoundPlan


def verify_batch(verifier: Verifier, costs: CostModel, decode_steps: int, batch: list[Sequence],
                 proposals: list[DraftProposal | None], ks: list[int], limits: list[int]) -> list[VerifyResult]:
    """`decode_steps`: the most tokens a plain row may decode in the call (EngineConfig.decode_steps)."""
    started = time.perf_counter()
    steps = _decode_steps(decode_steps, batch, ks)

    def verify() -> list[VerifyResult]:
        return verifier.verify([
            VerifyRequest(seq.request_id, seq.verify_synced, seq.context[seq.verify_synced :], proposal, seq.params,
                          seq.session_id, limit, len(seq.prompt), seq.scores_prompt, seq.cache_scope, seq.order,
                          n, seq.stop.stop_ids if n > 1 else frozenset())
            for seq, proposal, limit, n in zip(batch, proposals, limits, steps, strict=True)
        ])

    def forget(lost: list[str]) -> None:
        for seq in batch:
            if seq.request_id in lost:
                seq.verify_synced = 0

    results = _retry_lost(verify, forget)
    seconds = time.perf_counter() - started
    # Only rounds whose rows drafted alike are timed into the table of like rows' widths: an uneven round runs
    # padded or packed (core.row_layout), and the plan prices it from that table at the width it runs as. A
    # multi-step call is timed per forward where every row ran the same number.
    forwards = {1 + len(r.more) for r in results}
    if (len(set(ks)) == 1 and len(forwards) == 1 and all(seq.verify_synced == len(seq.context) for seq in batch)
            and not any(r.prefilling for r in results)):
        costs.observe_verify(ks[0] + 1, seconds / forwards.pop(), rows=len(batch))
    for seq in batch:
        seq.stats.verify_seconds += seconds
    return results


def _decode_steps(most: int, batch: list[Sequence], ks: list[int]) -> list[int]:
    """The tokens each row may decode in this verify call (EngineConfig.decode_steps), never past max_tokens: one
    for every row wherever a row drafts, or is new or prefilling (their batch mates' blocks would hold their
    outcome: a new row's first token streams as soon as without blocks). The verifier decodes one for rows that
    need the host between tokens."""
    if most == 1 or any(ks) or not all(seq.output for seq in batch):
        return [1] * len(batch)
    return [min(most, seq.params.max_tokens - len(seq.output)) for seq in batch]


def draft_batch(drafter: Drafter | None, costs: CostModel, batch: list[Sequence],
                plan: RoundPlan) -> list[DraftProposal | None]:
    """Proposals of the rows that draft; rows that only catch up (plan.catch_up) send their drafter the next
    part of their backlog and get no proposal."""
    ks, catch_up = plan.ks, plan.catch_up
    rows = [i for i, (k, c) in enumerate(zip(ks, catch_up, strict=True))
            if (k > 0 or c > 0) and not plan.from_prediction(i)]
    proposals: list[DraftProposal | None] = [None] * len(batch)
    if not rows:
        return proposals

    def requests() -> list[DraftRequest]:
        return [DraftRequest(batch[i].request_id, batch[i].draft_synced, batch[i].backlog(ks[i], catch_up[i]),
                             ks[i], batch[i].params, batch[i].session_id, len(batch[i].prompt),
                             batch[i].cache_scope, batch[i].order) for i in rows]

    def forget(lost: list[str]) -> None:
        for i in rows:
            if batch[i].request_id in lost:
                batch[i].draft_synced = 0

    started = time.perf_counter()
    try:
        sent, drafted = _retry_lost(lambda: ((r := requests()), drafter.propose(r)), forget)
    except KVCacheFull:  # a full draft cache: plain decoding this round
        for i in rows:
            batch[i].stats.draft_failures += 1
        forget([batch[i].request_id for i in rows])
        return proposals
    seconds = time.perf_counter() - started
    steps = max(len(p.tokens) for p in drafted)
    if steps and all(len(r.append) <= 1 for r in sent):
        costs.observe_draft_step(seconds / steps, rows=round(sum(len(p.tokens) for p in drafted) / steps))
    for i, request, proposal in zip(rows, sent, drafted, strict=True):
        batch[i].stats.draft_seconds += seconds
        batch[i].stats.draft_failures += proposal.failed
        if ks[i] > 0:
            proposals[i] = proposal
        elif not proposal.failed:  # caught up: the drafter holds these tokens now
            batch[i].draft_synced += len(request.append)
    return proposals


def commit_block(seq: Sequence, k: int, proposal: DraftProposal | None, result: VerifyResult, predicted: bool,
                 costs: CostModel, spec: SpecConfig, prior: policy.SharedPrior,
                 release: Callable[[Sequence], None]) -> StepOutput:
    """`predicted`: the drafts came from the request's prediction or its context (prompt lookup), not the drafter,
    whose policy they leave be.
    `release` lets the engine drop a sequence the block finishes."""
    committed, accepted = len(seq.context), result.accepted
    new_tokens = (proposal.tokens[:accepted] if proposal else []) + [result.next_token, *result.more]
    seq.verify_synced = committed + len(new_tokens)
    if seq.pace is not None and costs.calibrated:
        seq.pace.record(len(new_tokens), _priced_seconds(costs, k, predicted, committed - seq.draft_synced,
                                                         len(result.more)))
    if not predicted:
        if k > 0:
            seq.draft_synced = committed + accepted
        seq.stats.record_round(k, accepted, seq.policy.fallback, len(result.more))
        policy.update(seq.policy, k, accepted, costs, spec)
        policy.decoded_plainly(seq.policy, len(result.more))
        if k > 0:  # a failed proposal is empty: k 0
            prior.observe(k, accepted)
    before = len(seq.output)
    prompt_logprobs = None
    if seq.scores_prompt:
        if result.prompt_logprobs is None or len(result.prompt_logprobs) != len(seq.prompt) - 1:
            raise RuntimeError(f"the verifier scored {len(result.prompt_logprobs or ())} prompt tokens of "
                               f"{len(seq.prompt) - 1}")
        seq.prompt_logprobs = prompt_logprobs = list(result.prompt_logprobs)
    seq.finish_reason, seq.text_cut = seq.stop.extend(seq.output, new_tokens)
    if predicted:  # counted as far as the output goes: a stop may end it inside the accepted drafts
        kept = len(seq.output) - before
        record = seq.stats.record_predicted_round if seq.prediction is not None else seq.stats.record_lookup_round
        record(min(accepted, kept), k - accepted if kept > accepted else 0)
    if seq.params.min_tokens and len(seq.output) >= seq.params.min_tokens:
        # Held back no longer: the rounds after it reshape nothing for it (a plain row may decode in blocks).
        seq.params = dataclasses.replace(seq.params, min_tokens=0, end_ids=())
    if seq.finish_reason is not None:
        release(seq)
    emitted = seq.output[before:]
    if seq.params.logprobs is None:
        logprobs = None
    else:
        # The emitted tokens are a prefix of the block (a stop or max_tokens cuts it): so are their logprobs.
        logprobs = list((result.logprobs or [])[: len(emitted)])
        if len(logprobs) != len(emitted):
            raise RuntimeError(f"the verifier sent {len(logprobs)} logprobs for {len(emitted)} emitted tokens")
        seq.logprobs.extend(logprobs)
    return StepOutput(seq.request_id, emitted, seq.finish_reason, logprobs, prompt_logprobs)


def _priced_seconds(costs: CostModel, k: int, predicted: bool, behind: int, more: int) -> float:
    """What one row's round costs by the cost model: its verification, and for the draft model's drafts their steps
    and the drafter's catch-up on the `behind` tokens it had not seen; `more` one-token forwards after a plain one."""
    if predicted or k == 0:
        return costs.verify_time(k) + more * costs.verify_time(0)
    return costs.round_time(k) + costs.catch_up_time(behind)


def _retry_lost(call, forget):
    """Run `call`; if a worker lost some sequences, mark them for a full resend and run it once more."""
    try:
        return call()
    except StateLost as lost:
        forget(lost.seq_ids)
        return call()
