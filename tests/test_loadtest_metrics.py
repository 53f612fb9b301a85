"""loadtest/'s numbers on recorded traces with known answers: latency and throughput metrics, runs pooled end to
end, goodput under SLOs, the analytic bound (tandem.bench.bound) and the report's checks of the targets."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from google.protobuf.json_format import MessageToDict

from loadtest.metrics import compute, parse_slos
from loadtest.report.tables import markdown, target_checks
from loadtest.trace import CANCELLED, ERROR, NOT_SENT, OK, RequestTrace, RunTrace, concatenate, load, save
from tandem.bench.bound import (
    acceptance_needed_for_itl,
    cost_model,
    full_batch,
    itl_distribution,
    single_stream,
    weighted_percentile,
)
from tandem.v1 import generation_pb2 as pb


def _trace() -> RunTrace:
    requests = [
        RequestTrace(0, status=OK, send=0.0, end=1.5, chunk_times=[0.5, 0.75, 1.0, 1.5], chunk_tokens=[1, 2, 1, 4],
                     prompt_tokens=10, completion_tokens=8, rounds=4, drafted=6, accepted=4, fallback_rounds=1),
        RequestTrace(1, status=OK, send=1.0, end=3.0, chunk_times=[3.0], chunk_tokens=[1], prompt_tokens=20,
                     completion_tokens=1, rounds=1, fallback_rounds=1),
        RequestTrace(2, status=OK, send=2.0, end=2.75, chunk_times=[2.25, 2.5], chunk_tokens=[2, 3], prompt_tokens=30,
                     completion_tokens=5, rounds=2, drafted=4, accepted=3),
        RequestTrace(3, status=ERROR, send=3.0, end=3.5, error="UNAVAILABLE: draining"),
        RequestTrace(4, status=CANCELLED, send=4.0, end=9.0, chunk_times=[5.0], chunk_tokens=[1]),
        RequestTrace(5, status=NOT_SENT),
    ]
    return RunTrace(requests=requests, duration=10.0)


def test_metrics_on_a_recorded_trace_have_the_known_answers(tmp_path) -> None:
    trace = _trace()
    save(trace, tmp_path / "trace.jsonl")
    results = compute(load(tmp_path / "trace.jsonl"))
    approx = pytest.approx
    assert (results["completed"], results["failed"], results["errors"], results["cancelled"],
            results["not_sent"], results["requests"]) == (3, 2, 1, 1, 1, 6)
    assert results["error_kinds"] == {"UNAVAILABLE": 1}
    assert results["total_output_tokens"] == 14 and results["total_input_tokens"] == 60
    assert results["request_throughput"] == approx(0.3) and results["output_throughput"] == approx(1.4)
    assert results["total_token_throughput"] == approx(7.4)
    assert results["goodput"] == approx(0.3) and results["goodput_slos"] == {}  # no SLO: every completed one
    # TTFT 0.5, 2.0, 0.25; E2E 1.5, 2.0, 0.75 (numpy linear percentiles over the sorted values)
    assert results["ttft"] == approx({"mean": 2.75 / 3, "std": np.std([0.5, 2.0, 0.25]), "p50": 0.5, "p90": 1.7,
                                      "p99": 1.97, "max": 2.0, "count": 3})
    assert results["e2el"] == approx({"mean": 4.25 / 3, "std": np.std([1.5, 2.0, 0.75]), "p50": 1.5, "p90": 1.9,
                                      "p99": 1.99, "max": 2.0, "count": 3})
    # TPOT (e2el - ttft) / (tokens - 1): 1/7 and 0.5/4; the one-token request has none
    assert results["tpot"]["count"] == 2
    assert results["tpot"]["mean"] == approx((1 / 7 + 0.125) / 2) and results["tpot"]["p50"] == approx(15 / 112)
    # chunk gaps, one per chunk after the first: 0.25, 0.25, 0.5 and 0.25
    assert results["itl_chunk"] == approx({"mean": 0.3125, "std": np.std([0.25, 0.25, 0.5, 0.25]), "p50": 0.25,
                                           "p90": 0.425, "p99": 0.4925, "max": 0.5, "count": 4})
    # ITL per token: each gap split over its chunk's tokens: 0.125 x2, 0.25, 0.125 x4, 1/12 x3
    per_token = [0.125] * 6 + [0.25] + [1 / 12] * 3
    assert results["itl"] == approx({"mean": 0.125, "std": np.std(per_token), "p50": 0.125, "p90": 0.1375,
                                     "p99": 0.23875, "max": 0.25, "count": 10})
    assert results["tokens_per_chunk"] == approx(2.0)
    # Only request 0's first gap ends while nothing else is in flight (request 1 is sent at 1.0, request 2's chunk
    # at 2.5 arrives while request 1 runs).
    assert results["itl_alone"]["count"] == 2 and results["itl_alone"]["p50"] == approx(0.125)
    assert results["itl_shared"]["count"] == 8 and results["itl_shared"]["max"] == approx(0.25)
    assert results["itl_shared"]["mean"] == approx((0.25 + 4 * 0.125 + 3 / 12) / 8)
    assert results["alone_token_share"] == approx(0.2)
    assert results["acceptance_rate"] == approx(0.7) and results["fallback_share"] == approx(2 / 7)
    assert results["speculation"]["rounds"] == 7 and results["speculation"]["tokens_per_round"] == approx(2.0)


def test_runs_laid_end_to_end_pool_their_samples_without_false_company() -> None:
    single = compute(_trace())
    pooled = compute(concatenate([_trace(), _trace()]))
    assert pooled["duration"] == 20.0 and pooled["requests"] == 12 and pooled["completed"] == 6
    assert pooled["output_throughput"] == pytest.approx(single["output_throughput"])
    for key in ("itl", "itl_alone", "itl_shared", "ttft"):
        assert pooled[key]["count"] == 2 * single[key]["count"]
        assert pooled[key]["p50"] == pytest.approx(single[key]["p50"])
    assert pooled["alone_token_share"] == pytest.approx(single["alone_token_share"])


@pytest.mark.parametrize(("slos", "good"), [
    (["ttft:1000", "tpot:140"], 1),  # request 0's TPOT 142.9 ms misses, request 1's TTFT 2 s misses
    (["ttft:600", "e2el:1600"], 2),
    (["tpot:140"], 2),  # a one-token request has no TPOT and counts as 0 (as vLLM)
    (["e2el:100"], 0),
])
def test_goodput_counts_requests_meeting_every_slo(slos: list[str], good: int) -> None:
    results = compute(_trace(), parse_slos(slos))
    assert results["good_requests"] == good and results["goodput"] == pytest.approx(good / 10.0)


def test_empty_metrics_are_null_and_slo_flags_are_checked() -> None:
    results = compute(RunTrace(requests=[RequestTrace(0, status=ERROR, send=0.0, end=1.0, error="INTERNAL: x")],
                               duration=1.0))
    assert results["completed"] == 0 and results["failed"] == 1
    assert results["ttft"]["mean"] is None and results["ttft"]["count"] == 0
    assert results["acceptance_rate"] is None and results["fallback_share"] is None
    unsent = compute(replace(_trace(), planned=9))  # three more planned than recorded: never sent
    assert (unsent["requests"], unsent["not_sent"], unsent["completed"]) == (9, 4, 3)
    assert parse_slos(["ttft:500", "tpot:100", "e2el:2000"]) == {"ttft": 0.5, "tpot": 0.1, "e2el": 2.0}
    for bad in ("ttft", "itl:5", "ttft:-1", "ttft:x"):
        with pytest.raises(ValueError):
            parse_slos([bad])


def test_analytic_bound_has_the_known_answers() -> None:
    info = pb.GetModelInfoResponse(costs=pb.CostModel(
        draft_step_seconds=0.1, forward_seconds={n: 1.0 for n in range(1, 10)}, draft_rows_seconds={8: 0.4},
        draft_forward_seconds={16: 0.3},
        batched=[pb.BatchedForward(rows=8, width=w, seconds=2.0 + w) for w in (1, 2, 3)]))
    costs = cost_model(MessageToDict(info, preserving_proto_field_name=True))
    assert costs.draft_step == 0.1 and costs.draft_time(8) == 0.4 and costs.batch_forward_time(8, 2) == 4.0
    assert costs.draft_forward == {16: 0.3} and costs.round_time(2) == pytest.approx(1.2)
    # alpha 0.5: k 1 gives 1.5 tokens / 1.1 s, k 2 gives 1.75 / 1.2 s (best), k 3 gives 1.875 / 1.3 s
    single = single_stream(0.5, costs)
    assert single["k"] == 2 and single["speedup"] == pytest.approx(1.75 / 1.2)
    # k 2, round 1.2 s: a = 0 (p .5) one token at 1.2; a = 1 (p .25) two at 0.6; a = 2 (p .25) three at 0.4;
    # token shares 2/7, 2/7, 3/7
    flat = [x for pair in itl_distribution(0.5, 2, costs) for x in pair]
    assert flat == pytest.approx([1.2, 2 / 7, 0.6, 2 / 7, 0.4, 3 / 7])
    assert (single["itl_p50"], single["itl_p99"], single["off_itl"]) == pytest.approx((0.6, 1.2, 1.0))
    assert single["unaccepted_token_share"] == pytest.approx(0.5 / 1.75)
    # a full batch of 8: plain 8 tokens / 3 s; k 1: 8 x 1.5 / (0.4 + 4) s; k 2: 8 x 1.75 / (0.8 + 5) s
    batch = full_batch(0.5, 8, costs, k_max=2)
    assert batch["k"] == 1 and batch["speedup"] == pytest.approx((12 / 4.4) / (8 / 3))
    assert weighted_percentile([(3.0, 0.5), (1.0, 0.5)], 50) == 1.0
    # p99 within 1.02x: the rounds accepting nothing (ITL 1 + 0.1 k > 1.02) must carry at most 1% of tokens,
    # (1 - a) / E(a, k) <= 0.01, first reached at k = 8 (the longest blocks): a = 0.932 (0.931 gives 1.004%)
    assert acceptance_needed_for_itl(costs) == pytest.approx(0.932)


def test_report_checks_the_targets_per_level() -> None:
    sweep = {"runs": [], "ratios": [
        {"level": 0.05, "auto_vs_off": {"itl_p50": 0.7, "itl_p99": 1.5, "output_throughput": 1.2}},
        {"level": 0.3, "auto_vs_off": {"itl_p50": 1.01, "itl_p99": 1.0, "output_throughput": 1.0}},
        {"level": "inf", "auto_vs_off": {"itl_p50": 1.1, "itl_p99": None, "output_throughput": 0.99}}]}
    checks = target_checks(sweep)
    # lowest load: p50 must be 1.3x better; the highest: throughput at least OFF's
    assert [(c["itl_p50_met"], c["itl_p99_met"], c["saturation_throughput_met"]) for c in checks] == [
        (True, False, None), (True, True, None), (False, None, False)]
    assert checks[0]["itl_p50_limit"] == pytest.approx(1 / 1.3)
    text = markdown(sweep)
    assert "| 0.05 | 1.20 | - | 0.70 ok (<= 0.77) | 1.50 MISSED (<= 1.02) |" in text
    assert "| inf | 0.99 MISSED |" in text
