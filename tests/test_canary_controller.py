"""CanaryController against a real redis-server: weights honoured and sticky, runtime changes seen by a second
gateway replica, stepwise promotion and rollback from recorded outcomes, one decision per step across replicas,
Redis outages, and the exported metrics."""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter

import pytest
from scipy.stats import chisquare

from tandem.canary import (
    PROMOTE,
    ArmSpec,
    CanaryController,
    MemoryCanaryStore,
    Outcome,
    RedisCanaryStore,
    Thresholds,
    Verdict,
    parse_arms,
)
from tandem.canary.state import PROMOTED, ROLLED_BACK, RUNNING
from tandem.sessions import EmbeddedRedis

ARMS = parse_arms('[{"name": "stable", "draftModel": "d0", "weight": 70}, '
                  '{"name": "canary", "draftModel": "d1", "weight": 20}, {"name": "other", "kMax": 2, "weight": 10}]')
TWO_ARMS = parse_arms('[{"name": "stable", "weight": 95}, {"name": "canary", "draftModel": "d1", "weight": 5}]')


@pytest.fixture(scope="module")
def server():
    with EmbeddedRedis() as embedded:
        yield embedded


def deployment() -> str:
    return "test-" + uuid.uuid4().hex[:8]


def controller(url: str, name: str, arms=ARMS, **options) -> CanaryController:
    """A gateway replica's controller, started: its arms are registered unless the deployment already has some."""
    gateway = CanaryController(RedisCanaryStore(url), name, arms=arms, **options)
    gateway.refresh()
    return gateway


def test_weights_honoured_statistically(server) -> None:
    gateway = controller(server.url, deployment())
    n = 20_000
    counts = Counter(gateway.arm_for(f"session-{i}").arm.name for i in range(n))
    observed = [counts["stable"], counts["canary"], counts["other"]]
    expected = [0.7 * n, 0.2 * n, 0.1 * n]
    result = chisquare(observed, expected)
    assert result.pvalue > 1e-3, (observed, result)
    no_session = Counter(gateway.arm_for().arm.name for _ in range(5000))  # random per request
    assert chisquare([no_session[a] for a in ("stable", "canary", "other")], [3500, 1000, 500]).pvalue > 1e-4


def test_sessions_stick_to_their_arm_across_replicas_and_ramp_up(server) -> None:
    name = deployment()
    gateway_a, gateway_b = controller(server.url, name, TWO_ARMS), controller(server.url, name, TWO_ARMS)
    sessions = [f"user-{i}" for i in range(2000)]
    first = {s: gateway_a.arm_for(s).arm.name for s in sessions}
    assert all(gateway_a.arm_for(s).arm.name == arm for s, arm in first.items())
    assert all(gateway_b.arm_for(s).arm.name == arm for s, arm in first.items())
    assert all(gateway_a.arm_for(s, request_id=f"r{i}").arm.name == first[s] for i, s in enumerate(sessions))
    RedisCanaryStore(server.url).update(name, lambda state: state.promote("canary")[0])  # 5% -> 25%
    gateway_b.state(refresh=True)
    ramped = {s: gateway_b.arm_for(s).arm.name for s in sessions}
    assert all(ramped[s] == "canary" for s, arm in first.items() if arm == "canary")  # nobody moves back
    share = sum(arm == "canary" for arm in ramped.values()) / len(sessions)
    assert 0.21 < share < 0.29, share


def test_runtime_weight_change_reaches_a_second_replica(server) -> None:
    name = deployment()
    gateway_a = controller(server.url, name, TWO_ARMS, cache_ttl_s=0.2)
    gateway_b = controller(server.url, name, TWO_ARMS, cache_ttl_s=0.2)
    assert gateway_b.state().weights == {"stable": 95.0, "canary": 5.0}
    gateway_a.store.update(name, lambda state: state.with_weights({"stable": 40, "canary": 60})[0])
    deadline = time.monotonic() + 5
    while gateway_b.state().weights["canary"] != 60.0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gateway_b.state().weights == {"stable": 40.0, "canary": 60.0}
    counts = Counter(gateway_b.arm_for(f"s{i}").arm.name for i in range(4000))
    assert chisquare([counts["stable"], counts["canary"]], [1600, 2400]).pvalue > 1e-3
    gateway_c = controller(server.url, name, TWO_ARMS)  # a replica started later keeps the runtime weights
    assert gateway_c.state().weights == {"stable": 40.0, "canary": 60.0} and gateway_c.state().generation == 2


def feed(gateway: CanaryController, arm: str, sessions: int, acceptance: float, tpot: float = 0.01,
         error_every: int = 0) -> None:
    """Record one request per session for `arm`, as the gateway would after finishing it."""
    gateway.state(refresh=True)  # as its ticker would, between requests
    made = 0
    for _ in range(100_000):
        assignment = gateway.arm_for(f"{arm}-{uuid.uuid4().hex}")
        if assignment.arm.name != arm:
            continue
        error = bool(error_every) and made % error_every == 0
        gateway.record(assignment, Outcome(assignment.session, drafted=0 if error else 40,
                                           accepted=0 if error else round(40 * acceptance),
                                           tpot_s=None if error else tpot, error=error))
        made += 1
        if made == sessions:
            return


def test_stepwise_promotion_across_replicas_takes_each_step_once(server) -> None:
    name = deployment()
    th = Thresholds(min_sessions=10)
    replicas = [controller(server.url, name, TWO_ARMS, thresholds=th) for _ in range(3)]
    for step, expected in ((1, 25.0), (2, 50.0), (3, 100.0)):
        feed(replicas[0], "stable", 10, 0.8)
        feed(replicas[1], "canary", 9, 0.8)
        assert all(r.maybe_decide() == [] for r in replicas)  # 9 canary sessions: hold
        assert replicas[2].store.evaluation(name)["verdicts"]["canary"]["code"] == "min_sessions"
        feed(replicas[2], "canary", 1, 0.78)
        decisions = [record for r in replicas for record in r.maybe_decide()]
        assert len(decisions) == 1 and decisions[0].action == "promote", decisions  # one replica took the step
        # another replica that analysed the same generation cannot take the step again
        assert replicas[1]._apply(step, "canary", Verdict(PROMOTE, "healthy")) is None
        state = replicas[0].state(refresh=True)
        assert state.weights["canary"] == expected and state.generation == step + 1
    assert state.status == PROMOTED and [r.action for r in state.log] == ["register"] + ["promote"] * 3
    assert all(r.state(refresh=True).status == PROMOTED for r in replicas)
    assert all(r.arm_for(f"x{i}").arm.name == "canary" for r in replicas for i in range(50))


@pytest.mark.parametrize(("canary", "code"), [
    ({"acceptance": 0.3}, "acceptance_drop"),
    ({"acceptance": 0.8, "tpot": 0.02}, "tpot_p50"),
    ({"acceptance": 0.8, "error_every": 5}, "error_rate"),
])
def test_automatic_rollback(server, canary: dict, code: str, caplog) -> None:
    caplog.set_level(logging.INFO, logger="tandem.canary.decisions")
    name = deployment()
    gateway = controller(server.url, name, TWO_ARMS, thresholds=Thresholds(min_sessions=10), decide_every=5)
    gateway.store.update(name, lambda state: state.with_weights({"stable": 50, "canary": 50})[0])
    feed(gateway, "stable", 10, 0.8)
    feed(gateway, "canary", 10, **canary)
    state = gateway.state(refresh=True)
    assert state.status == ROLLED_BACK and state.weights == {"stable": 100.0, "canary": 0.0}
    record = state.log[-1]
    assert (record.action, record.code, record.source, record.arm) == ("rollback", code, "auto", "canary")
    assert any(r.levelno == logging.WARNING and "rollback canary" in r.getMessage() for r in caplog.records)
    assert gateway.metrics()["decisions"] == [{"arm": "canary", "action": "rollback", "reason": code,
                                               "source": "auto", "count": 1}]
    assert gateway.maybe_decide() == []  # rolled back: no more automatic decisions


def test_manual_mode_and_operator_changes_win(server) -> None:
    name = deployment()
    gateway = controller(server.url, name, TWO_ARMS, thresholds=Thresholds(min_sessions=5))
    gateway.store.update(name, lambda state: state.configured(auto=False)[0])
    feed(gateway, "stable", 5, 0.8)
    feed(gateway, "canary", 5, 0.1)
    assert gateway.maybe_decide() == [] and gateway.state(refresh=True).status == RUNNING


def test_redis_outage_keeps_routing_and_buffers(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="tandem.canary.controller")
    with EmbeddedRedis() as own:
        name = deployment()
        gateway = controller(own.url, name, TWO_ARMS, cache_ttl_s=0.05, retry_s=0.1)
        before = {f"s{i}": gateway.arm_for(f"s{i}").arm.name for i in range(200)}
        own.stop()
        time.sleep(0.1)
        started = time.monotonic()
        during = {s: gateway.arm_for(s).arm.name for s in before}
        assert during == before and time.monotonic() - started < 2.0
        assignment = gateway.arm_for("s1")
        gateway.record(assignment, Outcome(assignment.session, drafted=4, accepted=3, tpot_s=0.01))
        assert gateway.maybe_decide() == [] and gateway.metrics()["buffered"] == 1
        assert gateway.metrics()["store_errors"] >= 1 and not gateway.metrics()["store_healthy"]
        own.start()  # same port, empty: the configured arms are registered again, the buffer flushed
        deadline = time.monotonic() + 3
        while not gateway.metrics()["store_healthy"] and time.monotonic() < deadline:
            time.sleep(0.05)
            gateway.maybe_decide()
        assert gateway.metrics()["store_healthy"] and gateway.metrics()["buffered"] == 0
        assert RedisCanaryStore(own.url).load(name).weights == {"stable": 95.0, "canary": 5.0}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("unreachable" in m for m in warnings) == 1 and any("reachable again" in m for m in warnings)


def test_new_configuration_replaces_a_configured_experiment(server) -> None:
    name = deployment()
    controller(server.url, name, TWO_ARMS).refresh()
    changed = [TWO_ARMS[0], ArmSpec("canary-v2", 5.0, draft="d2")]
    gateway = controller(server.url, name, changed, served={"stable", "canary-v2"})
    state = gateway.state(refresh=True)
    assert set(state.weights) == {"stable", "canary-v2"} and state.generation == 2
    old = controller(server.url, name, TWO_ARMS, served={"stable", "canary"})  # an old replica during a rollout
    assert old.state(refresh=True).generation == 2  # it does not register its (replaced) arms again
    substitutes = [old.arm_for(f"s{i}") for i in range(400)]
    assert {a.arm.name for a in substitutes} == {"stable"} and any(a.fallback for a in substitutes)


def test_decisions_exported_as_opentelemetry_metrics() -> None:
    sdk = pytest.importorskip("opentelemetry.sdk.metrics")
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from tandem.telemetry.metrics import TIME_PER_OUTPUT_TOKEN_BUCKETS

    reader = InMemoryMetricReader()
    meter = sdk.MeterProvider(metric_readers=[reader]).get_meter("tandem.canary")
    gateway = CanaryController(MemoryCanaryStore(), "otel", arms=TWO_ARMS, meter=meter,
                               thresholds=Thresholds(min_sessions=3))
    feed(gateway, "stable", 3, 0.8)
    feed(gateway, "canary", 3, 0.1)
    assert gateway.maybe_decide()[0].action == "rollback"
    points = {metric.name: metric.data.data_points for rm in reader.get_metrics_data().resource_metrics
              for sm in rm.scope_metrics for metric in sm.metrics}
    (decision,) = points["tandem.canary.decisions"]
    assert dict(decision.attributes) == {"deployment": "otel", "arm": "canary", "action": "rollback",
                                         "reason": "acceptance_drop", "source": "auto"} and decision.value == 1
    requests = {p.attributes["arm"]: p.value for p in points["tandem.canary.requests"]}
    assert requests == {"stable": 3, "canary": 3}
    assert {p.attributes["arm"]: p.value for p in points["tandem.canary.weight"]} == {"stable": 100.0, "canary": 0.0}
    assert {p.attributes["arm"] for p in points["tandem.canary.tpot"]} == {"stable", "canary"}
    # Seconds a token in the gateway's buckets: not the SDK's defaults (0, 5, 10, ...), in whose first every one fell.
    assert all(tuple(p.explicit_bounds) == TIME_PER_OUTPUT_TOKEN_BUCKETS for p in points["tandem.canary.tpot"])


def test_background_ticker_refreshes_and_decides(server) -> None:
    name = deployment()
    gateway = controller(server.url, name, TWO_ARMS, thresholds=Thresholds(min_sessions=5), cache_ttl_s=0.05)
    gateway.start(decide_interval_s=0.2)
    try:
        RedisCanaryStore(server.url).update(name, lambda state: state.with_weights({"stable": 50, "canary": 50})[0])
        deadline = time.monotonic() + 5
        while gateway.state().generation != 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert gateway.state().weights == {"stable": 50.0, "canary": 50.0}  # refreshed by the ticker
        for i in range(40):  # what the gateway does per request: no store I/O on this thread
            assignment = gateway.arm_for(f"t{i}")
            good = assignment.arm.name == "stable"
            gateway.record(assignment, Outcome(assignment.session, drafted=10, accepted=8 if good else 1, tpot_s=0.01))
        while gateway.state().status == RUNNING and time.monotonic() < deadline:
            time.sleep(0.02)
        assert gateway.state().status == ROLLED_BACK and gateway.state().log[-1].code == "acceptance_drop"
    finally:
        gateway.close()


def test_serve_flags_and_environment_start_a_controller(server, monkeypatch) -> None:
    import argparse

    from tandem.canary.config import options_from_env, start_controller
    from tandem.cli.canary import add_serve_canary_options, serve_canary_options
    from tandem.errors import InvalidArgument

    env = {"TANDEM_CANARY_ARMS": '[{"name": "stable", "weight": 90}, {"name": "canary", "draftModel": "d", '
                                 '"weight": 10}]', "TANDEM_CANARY_DEPLOYMENT": deployment(),
           "TANDEM_CANARY_THRESHOLDS": '{"min_sessions": 7}', "TANDEM_CANARY_STEPS": "10,100"}
    options = options_from_env(env, greedy_check_rate=0.0)
    assert options.thresholds.min_sessions == 7 and options.steps == (10.0, 100.0)
    assert options_from_env({}) is None
    with pytest.raises(InvalidArgument, match=r"^thresholds: unknown \['nope'\]"):
        options_from_env(env | {"TANDEM_CANARY_THRESHOLDS": '{"nope": 1}'})
    gateway = start_controller(options, server.url, reference=lambda prompt, n: [])
    try:
        assert gateway.greedy is None  # rate 0: no checks
        assert gateway.state().weights == {"stable": 90.0, "canary": 10.0}
        assert RedisCanaryStore(server.url).load(options.deployment).thresholds.min_sessions == 7
    finally:
        gateway.close()

    parser = argparse.ArgumentParser()
    add_serve_canary_options(parser)
    args = parser.parse_args(["--canary-arms", env["TANDEM_CANARY_ARMS"], "--canary-deployment", "flags",
                              "--canary-threshold", "max_tpot_p99_ratio=1.5", "--canary-steps", "20", "50", "100"])
    options = serve_canary_options(args)
    assert (options.deployment, options.steps, options.thresholds.max_tpot_p99_ratio) == ("flags", (20, 50, 100), 1.5)
    monkeypatch.delenv("TANDEM_CANARY_ARMS", raising=False)
    assert serve_canary_options(parser.parse_args([])) is None
    with pytest.raises(InvalidArgument, match=r"^steps:"):
        serve_canary_options(parser.parse_args(["--canary-arms", env["TANDEM_CANARY_ARMS"], "--canary-steps", "50"]))
