"""How many tokens each sequence of a round may draft: every rule that bounds k, in one place.

`plan_round` applies these rules in order, per row and then over the batch:

0. A row whose request predicted its output (core.prediction) drafts from its prediction alone: where its output
   so far continues in the prediction, the predicted tokens that follow, as many of them (within rule 3's caps) as
   makes the most tokens per second of target forward at the acceptance its predicted drafts have had (a fixed k,
   adaptive off: all of them, as a fixed k drafts as given); elsewhere nothing. The draft model is never asked for
   it: its drafter would first have to catch up on the prompt and on every predicted token accepted (on the real
   pair, code edits ran 0.76x as fast with the draft model asked where the prediction offered nothing as with the
   target alone: docs/bench/predicted-outputs-draft-asked-v1.json, docs/performance.md "Predicted outputs"). Its
   policy is not asked and the rules below see it as a row that does not draft. Not in a round where it only
   prefills a chunk of its prompt, nor where its request's max_k is 0. With prompt lookup on (core.prompt_lookup),
   a row whose output's last tokens occur earlier in its context drafts the tokens that followed them there the
   same way, when that makes more tokens per second than its policy's drafts would (its draft model's rate at its
   acceptance, draft steps and catch-up paid; plain decoding's where the engine has no draft model): its policy is
   not asked that round, and its drafter catches up when the draft model drafts again. In an adaptive batch, once
   rule 4 has planned the drafting rows, each such free block (predicted or looked up) is kept only at the length,
   if any, that raises the batch's expected tokens per second (core.batch_plan.free_blocks_that_pay): it takes no
   draft step but widens the target's forward for every row. Elsewhere the rules below apply.
1. No drafting (k 0, the policy not asked): the engine is not speculating (no drafter, or speculation off), the
   request's max_k is 0, it is the row's first round under the adaptive policy's plain_first_round, or the row only
   prefills a chunk of its prompt this step.
2. The session's policy picks k (core.policy.decide). Its decision comes back with the plan, for the engine to apply
   once the round has run: a round that does not run (its batch shrinks to fit the KV cache) is planned afresh.
   With prompt lookup on, where copies have made the row's recent pace (core.prompt_lookup.Pace: its tokens per
   second, copies included) faster than plain decoding, the draft model's round must keep it: the tokens its drafts
   add beyond a plain round's one must be worth more, at that pace, than its draft steps and catch-up share cost
   beyond a plain round; else the row decodes plainly (the policy not asked). A drafted round spent on the few new
   tokens between two copies costs more than decoding them plainly and copying on (on the real pair's code edits,
   3 such rounds a request took 1.7 s of the 5 it ran). A probe out of fallback always runs.
3. Caps: the request's max_k, then remaining - 1 (the round's last token is the verifier's own, never a draft).
4. A batch of two or more rows under the adaptive policy: a row whose drafter is more than batch_catch_up_limit
   tokens behind drafts nothing this round. If the batch plan would let it draft once caught up (its whole catch-up
   priced), its drafter catches up on that many tokens of its backlog instead (`catch_up`), so no round stalls on a
   whole prompt and the row drafts a few rounds later. Then core.batch_plan prices the batched round with each
   drafting row's catch-up and sets every drafting row's k, up to k_max within its request's cap and tokens left
   (further than its policy's own k where its mates pay for the steps), or zeroes it. It prices each row at an
   optimistic acceptance (core.policy.optimistic_acceptance): a batch that drafted nothing until its rows'
   acceptance were known would never learn them. Once the deployment has measured its acceptance, a row that has
   never drafted and would not draft at that acceptance is charged its whole catch-up, not a share: it is explored
   only where that round pays for it. A fixed k (adaptive off) drafts as given, its drafter catching up on
   everything first. Any row, alone or not, adaptive or not, whose drafter is more than the engine's
   max_prefill_tokens behind catches up that many tokens a round instead of drafting (`catch_up_cap`), so that no
   draft step takes in a whole long prompt while other requests wait on the step.
5. Riders: where some row drafts this round, a row that does not (its policy asked: rule 1 keeps rows that never
   draft out; not on its last token) and whose drafter is at most CATCH_UP_ALONE_ABOVE tokens behind sends its
   drafter those tokens (`catch_up`), fed in the first draft step beside the drafting rows (a step spans its rows'
   slots, so a row between them is computed anyway). A row decoding plainly between its drafting rounds then never
   falls behind its drafter, and drafts again with no catch-up to pay.

The plan's k is the most a row may draft: the drafter may end a block sooner when its own top probability drops below
draft_confidence (it sees the draft's probabilities, which the plan does not), and a drafter that fails drafts nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.core import policy
from tandem.core.batch_plan import catch_up_share, free_blocks_that_pay, plan_batch, prices
from tandem.core.config import SpecConfig
from tandem.core.costs import CATCH_UP_ALONE_ABOVE, CostModel
from tandem.core.prediction import free_draft_rate, predicted_k


@dataclass(slots=True, frozen=True)
class RowView:
    """What the plan reads of one sequence of the batch; the plan never changes its policy state."""

    policy: policy.PolicyState
    max_k: int | None  # the request's cap on drafted tokens per round (None: no cap; 0: plain decoding)
    remaining: int  # tokens the request may still emit
    prefill_limit: int  # above 0: the verifier only prefills a chunk of the prompt this step
    first_round: bool  # the request has emitted nothing yet
    behind: int  # committed tokens the row's drafter has not seen (its catch-up)
    predicting: bool = False  # the request predicted its output (rule 0)
    predicted: int = 0  # predicted (or, without a prediction, looked-up) tokens that would follow the row's output
    prediction_acceptance: float = 0.0  # the share of those drafts accepted so far (the source's prior at first)
    pace: float = 0.0  # with prompt lookup: the row's recent tokens per second (core.prompt_lookup.Pace; 0: none)


@dataclass(slots=True, frozen=True)
class RoundPlan:
    ks: tuple[int, ...]  # per row, the most it may draft this round
    catch_up: tuple[int, ...]  # per row, backlog tokens its drafter catches up on without drafting (rule 4)
    decisions: tuple[policy.Decision | None, ...]  # per row, the policy's decision (None: the policy was not asked)
    predicted: tuple[bool, ...] = ()  # per row, whether its k drafts come from its prediction (rule 0)

    def from_prediction(self, row: int) -> bool:
        return bool(self.predicted) and self.predicted[row]


def plan_round(rows: Sequence[RowView], speculating: bool, spec: SpecConfig, costs: CostModel,
               prior: float, prior_measured: bool = True, catch_up_cap: int = 0) -> RoundPlan:
    """Each row's k and policy decision for one round (the rules in the module's docstring, in order). Pure: reads
    the rows, the costs and the prior, and changes none of them. `prior`: the deployment's recent acceptance;
    `prior_measured`: whether the deployment's sessions have measured it (policy.SharedPrior.measured);
    `catch_up_cap`: rule 4's bound for any row (EngineConfig.max_prefill_tokens; 0: none)."""
    costs = prices(costs)  # one plan: the tables stand still
    predicted = [_predicted(row, spec, costs) for row in rows]
    predicted = [p if row.predicting or _lookup_pays(row, p, speculating, spec, costs, prior) else 0
                 for row, p in zip(rows, predicted, strict=True)]
    decisions = [None if row.predicting or p else _decide(row, speculating, spec, costs, prior)
                 for row, p in zip(rows, predicted, strict=True)]
    ks = [_capped(row, decision, spec) for row, decision in zip(rows, decisions, strict=True)]
    catch_up = [0] * len(rows)
    if len(rows) > 1 and spec.adaptive:
        alphas = [policy.optimistic_acceptance(row.policy, spec, prior) for row in rows]
        limits = [_limit(row, spec) for row in rows]
        shares = [catch_up_share(costs, row.behind, alpha, k, row.remaining)
                  for row, alpha, k in zip(rows, alphas, ks, strict=True)]
        if prior_measured:
            shares = _explored_pay_whole(rows, ks, shares, limits, spec, costs, prior)
        far = [row.behind > spec.batch_catch_up_limit for row in rows]
        if any(far):
            # A far row's drafter catches up only where the batch would let it draft, its whole catch-up priced:
            # where batched drafting does not pay, no catch-up is spent on it.
            would_draft = plan_batch(ks, alphas, costs, shares, limits=limits)
            catch_up = [spec.batch_catch_up_limit if f and k > 0 else 0 for f, k in zip(far, would_draft, strict=True)]
            ks = [0 if f else k for f, k in zip(far, ks, strict=True)]
        ks = plan_batch(ks, alphas, costs, shares, limits=limits)
        if any(predicted):
            predicted = free_blocks_that_pay(ks, alphas, predicted, [row.prediction_acceptance for row in rows],
                                             costs, shares)
    if catch_up_cap:  # rule 4, for a lone row or a fixed k too: no draft step takes in a whole long prompt
        over = [k > 0 and row.behind > catch_up_cap for row, k in zip(rows, ks, strict=True)]
        catch_up = [catch_up_cap if o else c for o, c in zip(over, catch_up, strict=True)]
        ks = [0 if o else k for o, k in zip(over, ks, strict=True)]
    if any(ks):
        riders = _riders(rows, ks, decisions)
        catch_up = [row.behind if rider else c for row, c, rider in zip(rows, catch_up, riders, strict=True)]
    ks = [p or k for p, k in zip(predicted, ks, strict=True)]
    return RoundPlan(tuple(ks), tuple(catch_up), tuple(decisions), tuple(p > 0 for p in predicted))


def _predicted(row: RowView, spec: SpecConfig, costs: CostModel) -> int:
    """Rule 0: how many predicted tokens the row drafts (0: none)."""
    if not row.predicted or row.max_k == 0 or row.prefill_limit > 0:
        return 0
    offered = min(row.predicted, _limit(row, spec))
    return predicted_k(offered, row.prediction_acceptance, costs) if spec.adaptive else max(offered, 0)


def _lookup_pays(row: RowView, k: int, speculating: bool, spec: SpecConfig, costs: CostModel, prior: float) -> bool:
    """Rule 0 for looked-up drafts: whether k of them make more tokens per second than the row's policy would, at
    the acceptance each has had (plain decoding's rate where the engine has no draft model or the costs are not
    measured yet). The draft model's round pays its drafter's catch-up too: after a copy it is behind by every
    copied token, which a looked-up round never needs; and it is an alternative only where it keeps the row's pace
    (rule 2), else the alternative is plain decoding."""
    if k <= 0:
        return False
    rate, plain = (free_draft_rate(row.prediction_acceptance, width, costs) for width in (k, 0))
    if not speculating or row.max_k == 0 or not (spec.adaptive and costs.calibrated):
        return rate > plain
    alpha, catch_up = policy.acceptance(row.policy, spec, prior), costs.catch_up_time(row.behind)
    paced = _paced(row, costs)
    widths = [j for j in range(1, max(_limit(row, spec), 1) + 1) if not paced or _worth_at_pace(row, j, alpha, costs)]
    drafted = max((policy.expected_tokens(alpha, j) / (costs.round_time(j) + catch_up) for j in widths), default=0.0)
    return rate > max(drafted, plain)


def _explored_pay_whole(rows: Sequence[RowView], ks: list[int], shares: list[float], limits: list[int],
                        spec: SpecConfig, costs: CostModel, prior: float) -> list[float]:
    """Rule 4's catch-up prices once the deployment has measured its acceptance `prior`: a row that has never
    drafted and would not draft at that acceptance (the optimistic price alone sends it exploring) pays its whole
    catch-up, since its later rounds may never draft; every other row keeps its share. Before the prior is measured
    every share stays spread, so that a batch explores and the deployment learns its acceptance: else a deployment
    serving only batches, where batched drafting does not pay at the default prior, would never learn it (8 at once
    on CPU-A: the default 0.75, the pair's 0.85)."""
    new = [share > 0.0 and not policy.measured(row.policy) for row, share in zip(rows, shares, strict=True)]
    if not any(new):
        return shares
    expected = [policy.acceptance(row.policy, spec, prior) for row in rows]
    at_expected = plan_batch(ks, expected, costs, shares, limits=limits)
    return [costs.catch_up_time(row.behind) if n and not k else share
            for row, n, k, share in zip(rows, new, at_expected, shares, strict=True)]


def _decide(row: RowView, speculating: bool, spec: SpecConfig, costs: CostModel,
            prior: float) -> policy.Decision | None:
    """Rules 1 and 2: None where the row does not draft whatever its policy says, else its policy's decision."""
    plain_first = spec.adaptive and spec.plain_first_round and row.first_round
    if not speculating or row.max_k == 0 or plain_first or row.prefill_limit > 0:
        return None
    decision = policy.decide(row.policy, costs, spec, prior)
    keeps_pace = decision.probing or _keeps_pace(row, min(decision.k, _limit(row, spec)), spec, costs, prior)
    return decision if keeps_pace else None


def _keeps_pace(row: RowView, k: int, spec: SpecConfig, costs: CostModel, prior: float) -> bool:
    """Rule 2's pace: whether the draft model's k drafts are worth their cost at the row's recent pace. A round
    that makes E tokens where a plain one makes 1 saves the E - 1 tokens later rounds would have made at that pace,
    and costs its steps and catch-up share beyond a plain round. At plain decoding's pace that is E / its seconds >
    plain's rate, the policy's own test, so only a pace above it (copies) is asked; and never a probe (a policy in
    fallback measuring its acceptance again: held back, it would ask again every round and never measure it)."""
    if k <= 0 or not (spec.adaptive and costs.calibrated and _paced(row, costs)):
        return True
    return _worth_at_pace(row, k, policy.acceptance(row.policy, spec, prior), costs)


def _paced(row: RowView, costs: CostModel) -> bool:
    """Whether the row's recent pace (copies) is above plain decoding's rate, the only case rule 2 asks about."""
    return row.pace * costs.verify_time(0) > 1.0


def _worth_at_pace(row: RowView, k: int, alpha: float, costs: CostModel) -> bool:
    """Rule 2's test for k drafts at acceptance alpha: the E - 1 tokens beyond a plain round's, at the row's pace,
    against the seconds its steps and catch-up share cost beyond a plain round."""
    plain = costs.verify_time(0)
    seconds = costs.round_time(k) + catch_up_share(costs, row.behind, alpha, k, row.remaining)
    return (policy.expected_tokens(alpha, k) - 1.0) / row.pace > seconds - plain


def _capped(row: RowView, decision: policy.Decision | None, spec: SpecConfig) -> int:
    """Rule 3: the policy's k (never above k_max) within the request's cap and the tokens it has left."""
    return 0 if decision is None else min(decision.k, _limit(row, spec))


def _limit(row: RowView, spec: SpecConfig) -> int:
    """The most a row may draft: k_max within the request's cap and the tokens it has left."""
    return min(spec.k_max if row.max_k is None else min(spec.k_max, row.max_k), row.remaining - 1)


def _riders(rows: Sequence[RowView], ks: list[int], decisions: list[policy.Decision | None]) -> list[bool]:
    """Rule 5: the rows that send their drafter their last token or two with the first draft step (not a row on
    its last token: it finishes this round)."""
    return [k == 0 and decision is not None and row.remaining > 1 and 0 < row.behind <= CATCH_UP_ALONE_ABOVE
            for row, k, decision in zip(rows, ks, decisions, strict=True)]
