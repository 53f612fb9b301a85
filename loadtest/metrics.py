"""Metrics over a recorded RunTrace, with the definitions of vLLM's `bench serve` (all times in seconds).

Per completed request (status ok), with send = when the request was issued:
- TTFT: arrival of the first chunk carrying token ids − send.
- E2E latency (e2el): arrival of the last message on the stream (the Complete) − send.
- TPOT: (e2el − TTFT) / (output_tokens − 1), only for requests with more than one output token.
- ITL: the latency between successive output tokens. vLLM takes the gap between successive streamed chunks and
  assumes one token per chunk; tandem's gateway sends one chunk per engine round, and a speculative round commits
  several tokens at once, so each gap is divided by the tokens of the chunk that ends it and counted once per token
  (what SGLang's bench_serving does under speculative decoding). With one token per chunk this is vLLM's ITL.
  `itl_chunk` keeps the raw per-chunk gaps (vLLM's computation applied as is).
  `itl_alone` and `itl_shared` split the per-token ITL by the company its chunk arrived in: no other request in
  flight (issued and not yet ended, whatever its outcome) or at least one; `alone_token_share` is the first's share.
  Speculation's gain lives in the tokens a session decodes alone, so this split says how much of it a load level
  leaves room for.
Summaries: mean, std, p50, p90, p99 (numpy's default linear interpolation), max and count; null when empty.
Throughput: request_throughput = completed / duration, output_throughput = output tokens of completed requests /
duration, where duration runs from the benchmark's start to the end of its last request. goodput = completed
requests per second meeting every given SLO (metric <= SLO; TPOT counts as 0 for one-token requests, as vLLM); with
no SLO given every completed request counts, so goodput equals request_throughput.
Speculation (read from the server's Complete messages): acceptance_rate = accepted / drafted tokens and
fallback_share = fallback_rounds / rounds, both summed over completed requests.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from itertools import pairwise

import numpy as np

from loadtest.trace import CANCELLED, ERROR, OK, RequestTrace, RunTrace

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "e2el")


def parse_slos(items: Iterable[str]) -> dict[str, float]:
    """["ttft:500", "tpot:100"] (milliseconds, as vLLM's --goodput) -> {"ttft": 0.5, "tpot": 0.1} (seconds)."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"expected NAME:MILLISECONDS with NAME one of {', '.join(SLO_METRICS)}, got {item!r}")
        try:
            milliseconds = float(value)
        except ValueError:
            raise ValueError(f"{name}: not a number of milliseconds: {value!r}") from None
        if not milliseconds > 0:
            raise ValueError(f"{name}: must be positive, got {value!r}")
        slos[name] = milliseconds / 1000.0
    return slos


def summarize(values: Sequence[float]) -> dict:
    if len(values) == 0:
        return {"mean": None, "std": None, **{f"p{p}": None for p in PERCENTILES}, "max": None, "count": 0}
    array = np.asarray(values, dtype=float)
    return {"mean": float(array.mean()), "std": float(array.std()),
            **{f"p{p}": float(np.percentile(array, p)) for p in PERCENTILES},
            "max": float(array.max()), "count": int(array.size)}


def chunk_gaps(request: RequestTrace) -> list[float]:
    return [later - earlier for earlier, later in pairwise(request.chunk_times)]


def _token_itls(request: RequestTrace) -> Iterator[tuple[float, float]]:
    """(arrival of the chunk, per-token ITL), once per token of every chunk after the first."""
    for arrival, gap, n in zip(request.chunk_times[1:], chunk_gaps(request), request.chunk_tokens[1:], strict=True):
        for _ in range(n):
            yield arrival, gap / n


def itls(request: RequestTrace) -> list[float]:
    return [itl for _, itl in _token_itls(request)]


def itls_by_company(completed: list[RequestTrace], issued: list[RequestTrace]) -> tuple[list[float], list[float]]:
    """Per-token ITLs of the completed requests, split into (alone, shared) by whether any other issued request was
    in flight when the chunk arrived."""
    sends = sorted(r.send for r in issued if r.send is not None)
    ends = sorted(math.inf if r.end is None else r.end for r in issued if r.send is not None)
    alone: list[float] = []
    shared: list[float] = []
    for request in completed:
        for arrival, itl in _token_itls(request):
            in_flight = bisect_right(sends, arrival) - bisect_left(ends, arrival)  # this request included
            (alone if in_flight <= 1 else shared).append(itl)
    return alone, shared


def tpot(request: RequestTrace) -> float | None:
    if request.output_tokens <= 1 or request.ttft is None:
        return None
    return (request.latency - request.ttft) / (request.output_tokens - 1)


def meets(request: RequestTrace, slos: dict[str, float]) -> bool:
    values = {"ttft": request.ttft, "tpot": tpot(request) or 0.0, "e2el": request.latency}
    return all(values[name] is not None and values[name] <= limit for name, limit in slos.items())


def _ratio(numerator: int, denominator: int) -> float | None:
    return numerator / denominator if denominator else None


def speculation(completed: list[RequestTrace]) -> dict:
    totals = {name: sum(getattr(r, name) for r in completed)
              for name in ("rounds", "drafted", "accepted", "fallback_rounds", "draft_failures")}
    tokens = sum(r.output_tokens for r in completed)
    return {"acceptance_rate": _ratio(totals["accepted"], totals["drafted"]),
            "fallback_share": _ratio(totals["fallback_rounds"], totals["rounds"]),
            "speculation": {**totals, "tokens_per_round": _ratio(tokens, totals["rounds"]),
                            "draft_failure_share": _ratio(totals["draft_failures"], totals["rounds"])}}


def compute(trace: RunTrace, slos: dict[str, float] | None = None) -> dict:
    """The results.json body (without the run's config) for one recorded run."""
    slos = slos or {}
    completed = trace.by_status(OK)
    cancelled, errors, not_sent = len(trace.by_status(CANCELLED)), len(trace.by_status(ERROR)), trace.not_sent
    duration = trace.duration
    output_tokens = sum(r.output_tokens for r in completed)
    input_tokens = sum(r.prompt_tokens for r in completed)
    good = sum(meets(r, slos) for r in completed)
    alone, shared = itls_by_company(completed, trace.requests)

    def per_second(amount: float) -> float | None:
        return amount / duration if duration > 0 else None

    return {
        "requests": trace.planned,
        "completed": len(completed),
        "failed": errors + cancelled,
        "errors": errors,
        "cancelled": cancelled,
        "not_sent": not_sent,
        "error_kinds": dict(Counter(r.error.split(":", 1)[0] for r in trace.by_status(ERROR))),
        "duration": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per_second(len(completed)),
        "output_throughput": per_second(output_tokens),
        "total_token_throughput": per_second(input_tokens + output_tokens),
        "goodput": per_second(good),
        "goodput_slos": {name: slos[name] for name in SLO_METRICS if name in slos},
        "good_requests": good,
        "ttft": summarize([r.ttft for r in completed if r.ttft is not None]),
        "tpot": summarize([t for r in completed if (t := tpot(r)) is not None]),
        "itl": summarize([gap for r in completed for gap in itls(r)]),
        "itl_chunk": summarize([gap for r in completed for gap in chunk_gaps(r)]),
        "itl_alone": summarize(alone),
        "itl_shared": summarize(shared),
        "alone_token_share": _ratio(len(alone), len(alone) + len(shared)),
        "e2el": summarize([r.latency for r in completed if r.latency is not None]),
        "tokens_per_chunk": _ratio(output_tokens, sum(len(r.chunk_times) for r in completed)),
        **speculation(completed),
    }
