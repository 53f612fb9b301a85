"""End to end on tiny models: requests through in-process SpeculativeEngines behind the canary's arm router, the
state in a real redis-server. A random draft as the canary is rolled back automatically; the good draft is
promoted step by step; a canary that decodes with another model is caught by the greedy-equality check."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from canary_router import OfflineArmRouter, engine_reference
from tandem.canary import CanaryController, GreedyChecker, RedisCanaryStore, Thresholds, parse_arms
from tandem.canary.secret import CanarySecret
from tandem.canary.state import PROMOTED, ROLLED_BACK
from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.engines.local import build_engine
from tandem.sessions import EmbeddedRedis

CONFIG = EngineConfig(spec=SpecConfig(adaptive=False, k_init=4), calibrate=False)  # fixed k: repeatable
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
ARMS = parse_arms('[{"name": "stable", "draftModel": "tiny-draft", "weight": 90}, '
                  '{"name": "canary", "draftModel": "candidate", "weight": 10}]')
STEPS = (10, 25, 50, 100)
# The same thresholds judge the good and the bad canary. Acceptance is deterministic here (greedy, float32); TPOT
# is measured on a shared 2-core machine with millisecond tokens, so its limits are wide: the good canary runs the
# stable arm's very models, yet a loaded CI host once put its few-session p50 at 3.2x the stable arm's, and the p99 of
# such a window is nearly its maximum, which one scheduler stall can multiply. (The TPOT rules themselves are
# checked with exact figures in test_canary_analysis.)
THRESHOLDS = Thresholds(min_sessions=12, max_acceptance_drop=0.2, max_tpot_p50_ratio=10.0, max_tpot_p99_ratio=20.0,
                        min_greedy_checks=3)
MAX_REQUESTS = 600
# Sessions are placed by an HMAC keyed with this (without one, each process draws a random key, and each run takes
# another path through the trial).
SECRET = CanarySecret(b"tandem canary e2e test secret", "test")


@pytest.fixture(scope="module")
def server():
    with EmbeddedRedis() as embedded:
        yield embedded


def run_trial(url: str, deployment: str, target, stable_draft, canary_engine, checks: float = 0.5):
    """Drive requests (one new session each) until the canary is decided; returns (state, controller, routed).
    Arms and checks are chosen by hashes of the deployment and session names keyed by SECRET: every run takes the
    same path."""
    greedy = GreedyChecker(engine_reference(build_engine(target, None, CONFIG)), rate=checks, max_tokens=16,
                           inline=True)
    controller = CanaryController(RedisCanaryStore(url), deployment, arms=ARMS, thresholds=THRESHOLDS,
                                  steps=STEPS, decide_every=4, greedy=greedy, secret=SECRET)
    router = OfflineArmRouter(controller, {"stable": build_engine(target, stable_draft, CONFIG),
                                           "canary": canary_engine})
    rng = random.Random(7)
    routed = []
    for i in range(MAX_REQUESTS):
        prompt = [rng.randrange(3, 256) for _ in range(rng.randrange(4, 12))]
        routed.append(router.generate(prompt, PARAMS, session_id=f"session-{i}"))
        if controller.state().status != "running":
            break
    controller.close()
    return controller.store.load(deployment), controller, routed


def test_random_draft_canary_is_rolled_back(server, tiny_models) -> None:
    target, draft, draft_random = tiny_models
    state, controller, routed = run_trial(server.url, "random-draft", target, draft,
                                          build_engine(target, draft_random, CONFIG))
    assert state.status == ROLLED_BACK and state.weights == {"stable": 100.0, "canary": 0.0}
    record = state.log[-1]
    assert (record.action, record.arm, record.source, record.code) == ("rollback", "canary", "auto", "acceptance_drop")
    assert [r.action for r in state.log] == ["register", "rollback"]  # never promoted on the way
    by_arm = controller.metrics()["arms"]
    canary, stable = by_arm["canary"], by_arm["stable"]
    assert canary["accepted"] / canary["drafted"] < 0.2 < 0.4 < stable["accepted"] / stable["drafted"]
    assert canary["greedy_mismatches"] == 0  # a bad draft is slow, never wrong: speculation stays exact
    assert len(routed) < MAX_REQUESTS
    print(f"\nrolled back after {len(routed)} requests: {record.reasons}")


def test_good_draft_canary_is_promoted_stepwise(server, tiny_models) -> None:
    target, draft, _ = tiny_models
    state, controller, routed = run_trial(server.url, "good-draft", target, draft, build_engine(target, draft, CONFIG))
    assert state.status == PROMOTED, [(r.action, r.code, r.reasons) for r in state.log]
    assert [(r.action, r.weights_after["canary"]) for r in state.log] == [
        ("register", 10.0), ("promote", 25.0), ("promote", 50.0), ("promote", 100.0)]
    assert all(r.source == "auto" and r.code == "healthy" for r in state.log[1:])
    checks = controller.metrics()["arms"]["canary"]
    assert checks["greedy_checks"] >= 3 * THRESHOLDS.min_greedy_checks and checks["greedy_mismatches"] == 0
    print(f"\npromoted after {len(routed)} requests")


def test_canary_decoding_another_model_fails_the_greedy_check(server, tiny_models) -> None:
    target, draft, _ = tiny_models
    wrong = build_engine(draft, draft, CONFIG)  # a misconfigured arm: the draft model serves as its target
    state, _, routed = run_trial(server.url, "wrong-model", target, draft, wrong, checks=1.0)
    record = state.log[-1]
    assert state.status == ROLLED_BACK and record.code == "greedy_mismatch", record
    assert sum(r.assignment.arm.name == "canary" for r in routed) < THRESHOLDS.min_sessions  # at once, not later


def test_plain_reference_through_a_gateway_engine_loop(tiny_models) -> None:
    """The gateway's PlainReference: a max_k=0 request on its EngineLoop, from the checker's background thread."""
    from tandem.gateway.arms import plain_decoder
    from tandem.gateway.loop import EngineLoop

    target, draft, _ = tiny_models
    prompt = [72, 101, 108, 108, 111, 44, 32, 119]
    expected = engine_reference(build_engine(target, None, CONFIG))(prompt, 16)
    event_loop = asyncio.new_event_loop()
    thread = threading.Thread(target=event_loop.run_forever, daemon=True)
    thread.start()
    engine_loop = EngineLoop(build_engine(target, draft, CONFIG))
    try:
        asyncio.run_coroutine_threadsafe(engine_loop.start(), event_loop).result(10)
        checker = GreedyChecker(plain_decoder(engine_loop, event_loop, timeout_s=30), rate=1.0, max_tokens=16)
        results: list[bool] = []
        done = threading.Event()
        for output in (expected, expected[:5] + [(expected[5] + 1) % 256] + expected[6:]):
            done.clear()
            assert checker.submit(prompt, output, lambda match: (results.append(match), done.set()))
            assert done.wait(30)
        checker.close()
        assert results == [True, False]
        assert not engine_loop.engine.sequences  # the check requests finished and left nothing behind
    finally:
        asyncio.run_coroutine_threadsafe(engine_loop.close(), event_loop).result(30)
        event_loop.call_soon_threadsafe(event_loop.stop)
        thread.join(10)
