"""The canary's pure parts with known inputs: arm parsing, the analysis rules, state transitions, summaries."""

from __future__ import annotations

import pytest

from tandem.canary.analysis import HOLD, PROMOTE, ROLLBACK, Thresholds, evaluate
from tandem.canary.arms import ArmSpec, arms_from_env, fingerprint, parse_arms
from tandem.canary.observations import ArmSummary, Outcome, percentile, summarize
from tandem.canary.state import IDLE, LOG_LIMIT, PROMOTED, ROLLED_BACK, RUNNING, CanaryState, new_state
from tandem.core.config import SpecConfig
from tandem.errors import InvalidArgument

TH = Thresholds(min_sessions=20)


def summary(sessions: int = 40, acceptance: float | None = 0.8, p50: float = 0.010, p99: float = 0.020,
            errors: int = 0, checks: int = 0, mismatches: int = 0) -> ArmSummary:
    drafted = 1000 if acceptance is not None else 0
    return ArmSummary(requests=sessions, sessions=sessions, errors=errors, drafted=drafted,
                      accepted=round(drafted * (acceptance or 0)), tpot_p50=p50, tpot_p99=p99, greedy_checks=checks,
                      greedy_mismatches=mismatches)


# ---- analysis -----------------------------------------------------------------------------------------------------
def test_hold_below_min_sessions_on_either_arm() -> None:
    verdict = evaluate(summary(), summary(sessions=19, acceptance=0.1), TH)
    assert verdict.action == HOLD and verdict.code == "min_sessions" and "candidate 19" in verdict.reasons[0]
    assert evaluate(summary(sessions=5), summary(), TH).action == HOLD


def test_promote_when_healthy() -> None:
    verdict = evaluate(summary(), summary(acceptance=0.75, p50=0.0105, p99=0.024, errors=0), TH)
    assert verdict.action == PROMOTE and verdict.code == "healthy" and "40 sessions" in verdict.reasons[0]


@pytest.mark.parametrize(("candidate", "code", "text"), [
    (summary(acceptance=0.55), "acceptance_drop", "acceptance 0.550 vs baseline 0.800"),
    (summary(p50=0.0115), "tpot_p50", "TPOT p50 11.5 ms vs baseline 10 ms"),
    (summary(p99=0.026), "tpot_p99", "TPOT p99 26 ms vs baseline 20 ms"),
    (summary(errors=2), "error_rate", "error rate 0.050 vs baseline 0.000"),
])
def test_rollback_on_each_regression(candidate: ArmSummary, code: str, text: str) -> None:
    verdict = evaluate(summary(), candidate, TH)
    assert verdict.action == ROLLBACK and verdict.code == code and text in verdict.reasons[0], verdict


def test_rollback_names_every_regression() -> None:
    verdict = evaluate(summary(), summary(acceptance=0.1, p50=0.05, p99=0.1, errors=10), TH)
    assert verdict.action == ROLLBACK and verdict.code == "acceptance_drop"
    assert len(verdict.reasons) == 4


def test_within_thresholds_is_not_a_regression() -> None:
    # just inside each limit: acceptance drop 0.10, p50 ratio 1.10, p99 ratio 1.25, error increase 0.01
    base = ArmSummary(100, 100, 0, 1000, 800, 0.010, 0.020)
    cand = ArmSummary(100, 100, 1, 1000, 701, 0.0109, 0.0249)
    assert evaluate(base, cand, TH).action == PROMOTE


def test_plain_arms_skip_the_acceptance_rule() -> None:
    assert evaluate(summary(acceptance=None), summary(acceptance=None), TH).action == PROMOTE
    assert evaluate(summary(), summary(acceptance=None), TH).action == PROMOTE


def test_any_greedy_mismatch_rolls_back_at_once() -> None:
    verdict = evaluate(summary(checks=3), summary(sessions=2, checks=3, mismatches=1), TH)
    assert verdict.action == ROLLBACK and verdict.code == "greedy_mismatch" and "1/3 checks" in verdict.reasons[0]


def test_greedy_mismatch_rates_compared_when_the_baseline_mismatches_too() -> None:
    th = Thresholds(min_sessions=20, greedy_mismatch_tolerance=0.1, min_greedy_checks=10)
    noisy_base = summary(checks=20, mismatches=4)  # bf16 near-ties: 20% of checks differ on the baseline too
    assert evaluate(noisy_base, summary(checks=5, mismatches=2), th).action == PROMOTE  # too few checks to judge
    assert evaluate(noisy_base, summary(checks=20, mismatches=6), th).action == PROMOTE  # 30% <= 20% + 10%
    verdict = evaluate(noisy_base, summary(checks=20, mismatches=7), th)
    assert verdict.action == ROLLBACK and verdict.code == "greedy_mismatch" and "rate 0.350" in verdict.reasons[0]


def test_draft_canary_waits_for_greedy_checks() -> None:
    th = Thresholds(min_sessions=20, min_greedy_checks=3)
    verdict = evaluate(summary(), summary(checks=2), th, draft_canary=True)
    assert verdict.action == HOLD and verdict.code == "min_greedy_checks"
    assert evaluate(summary(), summary(checks=3), th, draft_canary=True).action == PROMOTE
    assert evaluate(summary(), summary(checks=0), th, draft_canary=False).action == PROMOTE


def test_thresholds_validation_and_text() -> None:
    th = Thresholds().with_text(["min_sessions=7", "max_tpot_p99_ratio=2"])
    assert th.min_sessions == 7 and th.max_tpot_p99_ratio == 2.0
    assert Thresholds.from_dict(th.to_dict()) == th
    for bad, field in ((["min_sessions=-1"], "min_sessions"), (["max_tpot_p50_ratio=0.5"], "max_tpot_p50_ratio"),
                       (["nope=1"], "thresholds"), (["min_sessions=x"], "min_sessions")):
        with pytest.raises(InvalidArgument, match=f"^{field}:"):
            Thresholds().with_text(bad)


# ---- observations -------------------------------------------------------------------------------------------------
def test_summary_of_outcomes() -> None:
    outcomes = [Outcome("a", drafted=8, accepted=6, tpot_s=0.01), Outcome("a", drafted=4, accepted=1, tpot_s=0.03),
                Outcome("b", error=True), Outcome.greedy_check("a", True), Outcome.greedy_check("b", False)]
    s = summarize(Outcome.from_json(o.to_json()) for o in outcomes)
    assert (s.requests, s.sessions, s.errors, s.drafted, s.accepted) == (3, 2, 1, 12, 7)
    assert s.acceptance == pytest.approx(7 / 12) and s.error_rate == pytest.approx(1 / 3)
    assert s.tpot_p50 == pytest.approx(0.02) and s.tpot_p99 == pytest.approx(0.0298)
    assert (s.greedy_checks, s.greedy_mismatches) == (2, 1)
    assert percentile([], 50) is None and percentile([5.0], 99) == 5.0
    timed = Outcome.from_request("a", {"drafted": 4, "accepted": 3}, first_token_at=1.0, finished_at=1.5,
                                 completion_tokens=11)
    assert timed.tpot_s == pytest.approx(0.05) and timed.accepted == 3
    with pytest.raises(InvalidArgument, match=r"^accepted:"):
        Outcome("a", drafted=1, accepted=2)


# ---- arms ---------------------------------------------------------------------------------------------------------
def test_parse_helm_arms() -> None:
    text = ('[{"name": "stable", "draftModel": "qwen2.5-coder-0.5b-instruct", "weight": 90}, '
            '{"name": "tiny-draft", "draftModel": "/models/tiny", "weight": 10, "kMax": 4, "enabled": true}]')
    arms = arms_from_env({"TANDEM_CANARY_ARMS": text})
    assert arms == parse_arms(text) and [a.name for a in arms] == ["stable", "tiny-draft"]
    assert arms[1] == ArmSpec("tiny-draft", 10.0, "", "/models/tiny", 4, True)
    assert arms[1].spec_config(SpecConfig(k_max=8, k_init=6)) == SpecConfig(k_max=4, k_init=4)
    assert arms_from_env({}) == ()
    assert fingerprint(arms) == fingerprint([a.with_weight(50) for a in arms])
    assert fingerprint(arms) != fingerprint([arms[0], ArmSpec("tiny-draft", 10, draft="/other")])


@pytest.mark.parametrize(("text", "field"), [
    ("{", "arms"), ('{"name": "a"}', "arms"), ("[]", "arms"),
    ('[{"name": "a", "weight": 60}, {"name": "b", "weight": 30}]', "weights"),
    ('[{"name": "a", "weight": 50}, {"name": "a", "weight": 50}]', "arms"),
    ('[{"name": "a b", "weight": 100}]', "name"), ('[{"weight": 100}]', "name"),
    ('[{"name": "a", "weight": 100, "color": "red"}]', "arms"), ('[{"name": "a", "weight": 101}]', "weight"),
    ('[{"name": "a", "weight": 100, "k_max": 99}]', "k_max"), ('[{"name": "a", "weight": "x"}]', "weight"),
])
def test_bad_arms_name_the_field(text: str, field: str) -> None:
    with pytest.raises(InvalidArgument, match=f"^{field}:"):
        parse_arms(text)


# ---- state transitions --------------------------------------------------------------------------------------------
def two_arms(canary: float = 5.0) -> list[ArmSpec]:
    return [ArmSpec("canary", canary, draft="new"), ArmSpec("stable", 100.0 - canary)]


def test_stepwise_promotion_to_full() -> None:
    state = new_state("dep", two_arms())
    assert state.baseline == "stable" and state.status == RUNNING and state.generation == 1
    seen = []
    while state.status == RUNNING:
        state, record = state.promote(source="auto", code="healthy")
        seen.append(state.weights["canary"])
        assert record.action == PROMOTE and record.weights_after == state.weights
    assert seen == [25.0, 50.0, 100.0] and state.status == PROMOTED and state.weights["stable"] == 0.0
    assert state.generation == 4 and [r.action for r in state.log] == ["register", PROMOTE, PROMOTE, PROMOTE]
    assert CanaryState.from_json(state.to_json()) == state


def test_rollback_and_manual_weights() -> None:
    state, record = new_state("dep", two_arms(25)).rollback(code="acceptance_drop", reasons=["bad"], source="auto")
    assert state.weights == {"canary": 0.0, "stable": 100.0} and state.status == ROLLED_BACK
    assert (record.weights_before, record.code, record.reasons) == ({"canary": 25.0, "stable": 75.0},
                                                                    "acceptance_drop", ("bad",))
    state, _ = state.with_weights({"stable": 100})
    assert state.status == IDLE
    state, _ = state.with_weights({"stable": 90, "canary": 10})
    assert state.status == RUNNING and state.generation == 4
    for weights, field in (({"stable": 90}, "weights"), ({"stable": 90, "nope": 10}, "weights")):
        with pytest.raises(InvalidArgument, match=f"^{field}:"):
            state.with_weights(weights)
    with pytest.raises(InvalidArgument, match=r"^arm: 'stable' is the baseline"):
        state.promote("stable")
    with pytest.raises(InvalidArgument, match=r"^to:"):
        state.promote("canary", to=5)


def test_three_arms_and_log_bound() -> None:
    arms = [ArmSpec("base", 80), ArmSpec("a", 10, draft="x"), ArmSpec("b", 10, k_max=2)]
    state = new_state("dep", arms, baseline="base", steps=(10, 30, 100))
    with pytest.raises(InvalidArgument, match=r"^arm: name one of a, b"):
        state.promote()
    state, _ = state.promote("a")
    assert state.weights == {"base": 60.0, "a": 30.0, "b": 10.0}
    for _ in range(LOG_LIMIT + 5):
        state, _ = state.configured(auto=False)
    assert len(state.log) == LOG_LIMIT and not state.auto
    with pytest.raises(InvalidArgument, match=r"^steps:"):
        state.configured(steps=(50, 25, 100))
