"""Seed an engine's cost model by timing the forwards its rounds are made of, before serving.

Single sequence: target forwards over every k + 1 tokens (k = 0..k_max), the draft step, and draft forwards over
several tokens (a drafter catching up). Batches: target forwards over n rows of w tokens each and draft steps over n
rows, with n real sequences in the runners' KV slots, as batched rounds run them, for the batch plan. A batched
forward is recorded under the rows it computes (the target's RowLayout: a compiled runner runs 6 rows as its 8-row
forward), the rows the batch plan prices it as; so every row count a batch can have lies within the measured ones,
and no price reads a single-sequence forward wider than k_max + 1 (the batch plan's only such read is for row
counts above every measured one).

Each shape runs several times and the fastest counts: first calls of a shape pay one-off kernel setup, and other
processes on the machine only ever make a call slower. For the same reason a forward is never priced above a wider
one with as many rows (nor a draft step above one over more rows): the lower timing is the less disturbed one.

It takes a few seconds on a GPU and minutes on a CPU (the real pair in one process on 2 AVX2 cores, --max-batch 8:
about 100 s in float32; `tandem serve` in bf16, --max-batch 16, was ready after 8.3 min), so a terminal shows a
progress bar, the log says how long it took and which row counts it timed, and `tandem serve` keeps the costs
for the next start (engines.calibration_file). Commands that run one stream (`tandem generate`,
`tandem bench`) calibrate with max_batch 1: single sequences alone, 7 s for that pair in float32.
"""

from __future__ import annotations

import contextlib
import logging
import time

from tqdm.auto import tqdm

from tandem.core.config import SamplingParams
from tandem.core.costs import CostModel
from tandem.core.protocol import Drafter, DraftProposal, DraftRequest, Verifier, VerifyRequest

log = logging.getLogger(__name__)

CALIBRATION_ID = "__tandem_calibration__"
BATCH_ROWS = (2, 4, 8, 16)
BATCH_WIDTHS = (1, 2, 3, 5)
CATCH_UP_WIDTHS = (4, 8, 16, 32)
CONTEXT = 32  # tokens of each calibration sequence before the widths it times


def kv_tokens_needed(k_max: int, max_batch: int, context: int = CONTEXT) -> int:
    """The KV budget calibration takes: max_batch sequences of `context` tokens and k_max drafts."""
    return max(1, max_batch) * (context + k_max)


class _Failed(Exception):
    """A calibration call that did no work: a pool worker failed or missed its deadline (its rows got empty
    proposals). Timed, it would price a draft step at the cost of doing nothing."""


def _timed(call) -> float:
    """Seconds per unit of work: a call returns how many units it did (draft steps taken), or None for one."""
    started = time.perf_counter()
    units = call()
    return (time.perf_counter() - started) / (units or 1)


def _fastest_each(calls: dict, passes: int, bar: tqdm) -> dict:
    """The fastest of `passes` timings per call (per unit, `_timed`), the passes interleaved so a slow spell does
    not hit one shape, after one untimed call of each (a shape's first call sets up its kernels: it would leave one
    timing that counts, and one slow spell would then price that shape at twice its cost for as long as the plan
    avoids it). A call that failed counts no timing; a shape with none is left out (the cost model extrapolates it;
    with no draft step timed it is not calibrated, and AUTO drafts at its initial k)."""
    for call in calls.values():
        with contextlib.suppress(_Failed):
            call()
        bar.update()
    best: dict = {}
    for _ in range(passes):
        for key, call in calls.items():
            try:
                seconds = _timed(call)
            except _Failed:
                log.warning("calibration: a draft call failed (see the pool's warning); its timing is left out")
                continue
            finally:
                bar.update()
            best[key] = min(best.get(key, seconds), seconds)
    return best


def calibrate(verifier: Verifier, drafter: Drafter | None, k_max: int, k_init: int, max_batch: int,
              context: int = CONTEXT, passes: int = 3) -> CostModel:
    """A fresh CostModel measured on `verifier` and `drafter`, for rounds of up to k_max drafts and max_batch rows.
    Without a drafter (prompt lookup's drafts alone), the target's forwards only."""
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    prompt = [i % verifier.vocab_size for i in range(1, context + 1)]
    rows = sorted({n for n in BATCH_ROWS if n < max_batch} | ({max_batch} if max_batch > 1 else set()))
    ids = [f"{CALIBRATION_ID}-{i}" for i in range(max(rows, default=1))]

    def verify(n: int, width: int) -> None:
        draft = DraftProposal(tokens=[prompt[0]] * (width - 1))
        verifier.verify([VerifyRequest(seq_id, context - 1, [prompt[-1]], draft, greedy) for seq_id in ids[:n]])

    def draft(n: int, steps: int, width: int = 1) -> int:
        """Steps the drafter took: a confidence stop may end a block before `steps`."""
        proposals = drafter.propose([DraftRequest(seq_id, context - width, prompt[-width:], steps, greedy)
                                     for seq_id in ids[:n]])
        if any(p.failed for p in proposals):
            raise _Failed
        return max((len(p.tokens) for p in proposals), default=0)

    costs = CostModel(layout=verifier.row_layout)
    shapes = [(n, w) for n in rows for w in BATCH_WIDTHS if w <= k_max + 1]
    draft_rows = [1, *rows] if drafter is not None else []
    # Draft forwards over several tokens: a batched row's catch-up, and a lone row's after its rounds copied from
    # its context (prompt lookup), which the plan weighs against the draft model's rounds.
    catch_up = [w for w in CATCH_UP_WIDTHS if w <= context] if drafter is not None else []
    calls = 1 + bool(draft_rows) + (k_max + 1 + len(shapes) + len(draft_rows)) * (1 + passes) + len(catch_up) * 3
    started = time.perf_counter()
    with tqdm(total=calls, desc="calibrating", unit="call", disable=None, leave=False) as bar:
        verifier.verify([VerifyRequest(seq_id, 0, prompt, None, greedy) for seq_id in ids])
        bar.update()
        single = _fastest_each({w: lambda w=w: verify(1, w) for w in range(1, k_max + 2)}, passes, bar)
        for width, seconds in single.items():
            costs.observe_verify(width, seconds)
        for (n, width), seconds in _fastest_each({s: lambda s=s: verify(*s) for s in shapes}, passes, bar).items():
            costs.observe_verify(width, seconds, rows=n)
        for seq_id in ids:
            verifier.release(seq_id)
        if drafter is not None:
            drafter.propose([DraftRequest(seq_id, 0, prompt, 1, greedy) for seq_id in ids])
            bar.update()
            # One row and every row count in the same passes, each per step of a block as rounds draft it: timed apart,
            # a slow spell over one block once priced every batched step at twice the single one (0.08-0.12 s against
            # 0.05).
            steps = max(k_init, 2)
            for n, seconds in _fastest_each({n: lambda n=n: draft(n, steps) for n in draft_rows}, passes, bar).items():
                costs.observe_draft_step(seconds, rows=n)
            if catch_up:
                costs.draft_forward = _fastest_each({w: lambda w=w: draft(1, 1, w) for w in catch_up}, 2, bar)
            for seq_id in ids:
                drafter.release(seq_id)
    log.info("calibrated in %.1f s (%d target and draft calls; rows %s)", time.perf_counter() - started, calls,
             ", ".join(map(str, [1, *rows])))
    _cap_by_larger(costs)
    return costs


def _cap_by_larger(costs: CostModel) -> None:
    def capped(times: dict) -> dict:
        out, cheapest = {}, float("inf")
        for size in sorted(times, reverse=True):
            cheapest = out[size] = min(cheapest, times[size])
        return out

    costs.verify = capped(costs.verify)
    for n in {rows for rows, _ in costs.batched}:
        widths = capped({w: s for (r, w), s in costs.batched.items() if r == n})
        costs.batched.update({(n, w): s for w, s in widths.items()})
    costs.draft_rows = capped(costs.draft_rows)
    costs.draft_forward = capped(costs.draft_forward)
    costs.draft_step = min([costs.draft_step, *costs.draft_rows.values()])
