"""No single tenant decides a canary: each tenant's weight in an arm's statistics is capped (max_tenant_share), and a
verdict that leaving one tenant out would change is a hold. One tenant flooding the candidate with slow requests does
not roll it back while the other tenants see it as fine; without the cap, or with every tenant slow, it does. The
pure parts with known inputs, then through CanaryController on a real redis-server."""

from __future__ import annotations

import random
import uuid

import pytest

from tandem.canary import (
    HOLD,
    PROMOTE,
    ROLLBACK,
    CanaryController,
    CanarySecret,
    Outcome,
    RedisCanaryStore,
    Thresholds,
    judge,
    parse_arms,
    summarize,
)
from tandem.canary.analysis import TENANT_SKEW
from tandem.canary.observations import percentile
from tandem.canary.state import ROLLED_BACK, RUNNING
from tandem.canary.tenants import capped_total, tenant_factors, weighted_percentile
from tandem.errors import InvalidArgument
from tandem.sessions import EmbeddedRedis

TH = Thresholds(min_sessions=20)
HONEST = [f"tenant-{i}" for i in range(6)]
ARMS = parse_arms('[{"name": "stable", "weight": 50}, {"name": "canary", "draftModel": "d1", "weight": 50}]')


def requests(tenant: str, sessions: int, tpot: float = 0.010, acceptance: float = 0.8, drafted: int = 40,
             per_session: int = 1) -> list[Outcome]:
    """`per_session` requests in each of `sessions` sessions of `tenant`, TPOT spread a little around `tpot`."""
    return [Outcome(f"{tenant}/{s}", drafted=drafted, accepted=round(drafted * acceptance),
                    tpot_s=tpot * (1 + 0.02 * ((s + r) % 5)), tenant=tenant)
            for s in range(sessions) for r in range(per_session)]


def honest(sessions: int = 10, **kind) -> list[Outcome]:
    return [outcome for tenant in HONEST for outcome in requests(tenant, sessions, **kind)]


# ---- the weights ------------------------------------------------------------------------------------------------
def test_tenant_factors_cap_every_share() -> None:
    rng = random.Random(7)
    for _ in range(200):
        totals = {f"t{i}": rng.choice([1, 3, 10, 50, 400, 5000]) for i in range(rng.randint(4, 12))}
        for cap in (0.1, 0.25, 0.5):
            factors = tenant_factors(totals, cap)
            weights = {t: totals[t] * factors[t] for t in totals}
            total = sum(weights.values())
            share = max(cap, 1 / len(totals))
            assert all(w <= share * total * (1 + 1e-9) for w in weights.values()), (totals, cap, weights)
            level = max(weights.values())  # tenants are either uncapped or cut to one common level
            assert all(factors[t] == 1.0 or weights[t] == pytest.approx(level) for t in totals)
            if max(totals.values()) > share * sum(totals.values()):  # a cap binds: the heaviest sits at it
                assert max(weights.values()) == pytest.approx(share * total)
    assert tenant_factors({"": 900}, 0.25) == {"": 1.0}  # one (anonymous) tenant: nothing to cap
    assert tenant_factors({"a": 1000, "b": 10}, 0.25) == {"a": 0.01, "b": 1.0}  # too few tenants: equal weights
    assert tenant_factors({"a": 1000, "b": 10}, 1.0) == {"a": 1.0, "b": 1.0}
    assert capped_total({"a": 500, **{t: 10 for t in HONEST}}, 0.25) == pytest.approx(80)  # 60 + 20 (a quarter)


def test_weighted_percentile_is_the_plain_one_with_equal_weights() -> None:
    rng = random.Random(3)
    for n in (1, 2, 3, 10, 101):
        values = [rng.random() for _ in range(n)]
        for q in (0, 1, 50, 99, 100):
            assert weighted_percentile([(v, 2.5) for v in values], q) == pytest.approx(percentile(values, q))
    assert weighted_percentile([], 50) is None
    assert weighted_percentile([(1.0, 3.0), (2.0, 1.0)], 50) == pytest.approx(1.0)  # 3 of 4 weight sits at 1


def test_summary_caps_each_statistic_by_its_own_weight() -> None:
    # A tenant with a quarter of the requests but long generations would hold most drafted tokens: acceptance is
    # capped by drafted tokens, so it too gives the tenant at most a quarter.
    window = honest(10) + requests("mallory", 20, acceptance=0.0, drafted=2000)
    summary = summarize(window, 0.25)
    assert summary.acceptance == pytest.approx(0.75 * 0.8)
    assert summary.observed == 80 and summary.tenants == 7 and summary.sessions == pytest.approx(80)
    assert summarize(window, 1.0).acceptance == pytest.approx(0.8 * 2400 / (2400 + 40_000))
    errors = honest(10) + [Outcome(f"m{i}", error=True, tenant="mallory") for i in range(500)]
    assert summarize(errors, 0.25).error_rate == pytest.approx(0.25)


def test_anonymous_traffic_is_judged_as_before() -> None:
    base = requests("", 30)
    cand = requests("", 30, tpot=0.012)
    verdict, _, cand_summary = judge(base, cand, TH)
    assert verdict.action == ROLLBACK and verdict.code == "tpot_p50"
    plain = summarize(cand, 1.0)
    assert (cand_summary.requests, cand_summary.sessions, cand_summary.tpot_p99) == (30, 30, plain.tpot_p99)
    named = Outcome("x", drafted=4, accepted=3, tpot_s=0.01, at=12.5, tenant="acme")
    assert Outcome.from_json(named.to_json()) == named and '"tn":"acme"' in named.to_json()
    assert '"tn"' not in cand[0].to_json() and Outcome.from_json(cand[0].to_json()).tenant == ""


# ---- one slow tenant ----------------------------------------------------------------------------------------------
def test_one_slow_tenant_does_not_roll_the_candidate_back() -> None:
    base = honest()
    flood = requests("mallory", 400, tpot=0.100, acceptance=0.1)
    verdict, _, cand = judge(base, honest() + flood, TH)
    assert verdict.action == HOLD and verdict.code == TENANT_SKEW, verdict
    assert "rests on tenant 'mallory'" in verdict.reasons[0] and "without it, promote (healthy" in verdict.reasons[0]
    assert cand.sessions == pytest.approx(80) and cand.tpot_p50 < 0.011  # the flood weighs a quarter

    # Without the cap the flood is the candidate's statistics, and decides alone.
    uncapped = judge(base, honest() + flood, Thresholds(min_sessions=20, max_tenant_share=1.0))[0]
    assert uncapped.action == ROLLBACK and uncapped.code == "acceptance_drop", uncapped
    # Every tenant slow: a real regression, whoever is left out.
    everyone = judge(base, honest(tpot=0.100, acceptance=0.1) + flood, TH)[0]
    assert everyone.action == ROLLBACK and everyone.code == "acceptance_drop", everyone
    assert any(reason.startswith("TPOT p50") for reason in everyone.reasons), everyone
    # A healthy candidate with a fine flood is promoted.
    assert judge(base, honest() + requests("mallory", 400), TH)[0].action == PROMOTE


def test_a_tenant_with_few_requests_but_most_drafted_tokens_does_not_decide_either() -> None:
    # Under 1% of the candidate's requests, but long generations at zero acceptance: capped to a quarter of the drafted
    # tokens that is still a 0.2 drop, and it is left out like any tenant heavy in some statistic.
    cand = honest(100) + requests("mallory", 5, acceptance=0.0, drafted=40_000)
    verdict = judge(honest(), cand, TH)[0]
    assert verdict.action == HOLD and verdict.code == TENANT_SKEW and "'mallory'" in verdict.reasons[0], verdict
    assert "acceptance" in verdict.reasons[1]


def test_a_flood_alone_does_not_make_the_candidate_ready() -> None:
    few = [outcome for tenant in HONEST[:2] for outcome in requests(tenant, 3)]
    verdict = judge(honest(), few + requests("mallory", 1000, tpot=0.1), TH)[0]
    assert verdict.action == HOLD and verdict.code == "min_sessions", verdict  # 6 + 3 capped sessions, not 1006


def test_one_tenant_cannot_mask_a_regression_either() -> None:
    # The candidate's draft is bad for everyone's prompts; one tenant floods it with trivially predictable ones.
    bad = honest(acceptance=0.3) + requests("mallory", 400, acceptance=1.0, drafted=400)
    assert judge(honest(), bad, Thresholds(min_sessions=20, max_tenant_share=1.0))[0].action == PROMOTE
    verdict = judge(honest(), bad, TH)[0]
    assert verdict.action == ROLLBACK and verdict.code == "acceptance_drop", verdict


def test_two_tenants_one_of_them_slow() -> None:
    # Fewer tenants than 1 / cap: they weigh equally, and neither decides alone.
    base = requests("alice", 30) + requests("bob", 30)
    cand = requests("alice", 30) + requests("bob", 300, tpot=0.1)
    verdict = judge(base, cand, TH)[0]
    assert verdict.action == HOLD and verdict.code == TENANT_SKEW and "'bob'" in verdict.reasons[0], verdict


def test_max_tenant_share_is_validated_and_stored() -> None:
    assert Thresholds().max_tenant_share == 0.25 and "max_tenant_share" not in Thresholds().to_dict()
    th = Thresholds().with_text(["max_tenant_share=0.5"])
    assert th.max_tenant_share == 0.5 and Thresholds.from_dict(th.to_dict()) == th
    for bad in ("0", "1.5", "-0.1"):
        with pytest.raises(InvalidArgument, match=r"^max_tenant_share: must be in \(0, 1\]"):
            Thresholds().with_text([f"max_tenant_share={bad}"])


# ---- through the controller and Redis -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    with EmbeddedRedis() as embedded:
        yield embedded


def gateway_on(url: str, **thresholds) -> CanaryController:
    gateway = CanaryController(RedisCanaryStore(url), "tenants-" + uuid.uuid4().hex[:8], arms=ARMS,
                               thresholds=Thresholds(min_sessions=10, **thresholds),
                               secret=CanarySecret(uuid.uuid4().bytes * 2, "test"))
    gateway.refresh()
    return gateway


def serve(gateway: CanaryController, tenant: str, sessions: int, arm: str | None = None, tpot: float = 0.010,
          acceptance: float = 0.8) -> None:
    """Requests of `tenant` as the gateway records them; with `arm`, only sessions placed there (a client that
    found out, by timing its responses, which of its sessions the candidate serves, and floods only those)."""
    made = 0
    for i in range(100_000):
        assignment = gateway.arm_for(f"{tenant}-{i}", tenant=tenant)
        if arm is not None and assignment.arm.name != arm:
            continue
        gateway.record(assignment, Outcome(assignment.session, drafted=40, accepted=round(40 * acceptance),
                                           tpot_s=tpot * (1 + 0.02 * (i % 5))))
        made += 1
        if made == sessions:
            return


@pytest.mark.parametrize(("thresholds", "everyone_slow", "expected"), [
    ({}, False, RUNNING),
    ({"max_tenant_share": 1.0}, False, ROLLED_BACK),
    ({}, True, ROLLED_BACK),
])
def test_a_slow_tenant_flood_through_the_controller(server, thresholds: dict, everyone_slow: bool,
                                                    expected: str) -> None:
    gateway = gateway_on(server.url, **thresholds)
    for tenant in HONEST:
        slow = {"tpot": 0.1, "acceptance": 0.1} if everyone_slow else {}
        serve(gateway, tenant, 12, "stable")
        serve(gateway, tenant, 12, "canary", **slow)
    serve(gateway, "mallory", 300, "canary", tpot=0.1, acceptance=0.1)
    gateway.maybe_decide()
    state = gateway.state(refresh=True)
    assert state.status == expected, state.log[-1]
    window = gateway.store.outcomes(gateway.deployment, 1, "canary", 2000)
    assert {o.tenant for o in window} == {*HONEST, "mallory"}  # every outcome names its tenant, through Redis
    evaluation = gateway.store.evaluation(gateway.deployment)
    if expected == RUNNING:
        assert evaluation["verdicts"]["canary"]["code"] == TENANT_SKEW
        assert evaluation["arms"]["canary"]["observed"] == 372 and evaluation["arms"]["canary"]["tenants"] == 7
        assert evaluation["arms"]["canary"]["sessions"] == pytest.approx(96)  # 72 + mallory's quarter
    else:
        assert state.log[-1].action == "rollback" and state.log[-1].source == "auto"
