"""Canary arms in a real gateway: sessions routed over gRPC to per-arm engines on the tiny models, the canary state
and observations in a real redis-server. Sessions stick to their arm and weights are honoured; with API keys the
caller's tenant keys the assignment and is recorded with every outcome; a random-draft canary is rolled back
automatically from the traffic it served; greedy output is plain decoding's on every arm."""

from __future__ import annotations

import time
import uuid
from collections import Counter

import pytest

from gateway_harness import ServerThread
from tandem.canary import RedisCanaryStore, Thresholds, parse_arms
from tandem.canary.assignment import session_key, short_hash
from tandem.canary.config import CanaryOptions
from tandem.canary.plugin import CanaryArms
from tandem.canary.state import ROLLED_BACK
from tandem.client import TandemClient
from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.engines import Backend
from tandem.engines.local import build_engine
from tandem.gateway.auth import ApiKeys, create_key
from tandem.gateway.generation import scoped_id
from tandem.sessions import EmbeddedRedis, open_session_store
from tandem.v1 import generation_pb2 as pb

CONFIG = EngineConfig(spec=SpecConfig(adaptive=False, k_init=4), calibrate=False)  # fixed k: repeatable
NEW_TOKENS = 16
GREEDY = {"temperature": 0.0, "max_tokens": NEW_TOKENS, "ignore_eos": True}
ARMS = parse_arms('[{"name": "stable", "draftModel": "tiny-draft", "weight": 50}, '
                  '{"name": "canary", "draftModel": "candidate", "weight": 50}]')


@pytest.fixture(scope="module")
def redis_server():
    with EmbeddedRedis() as embedded:
        yield embedded


def arms_loader(target, stable_draft, canary_draft):
    def load() -> dict[str, Backend]:
        return {"stable": Backend(build_engine(target, stable_draft, CONFIG), target.tokenizer, "tiny-target",
                                  "tiny-draft"),
                "canary": Backend(build_engine(target, canary_draft, CONFIG), target.tokenizer, "tiny-target",
                                  "candidate")}

    return load


def start(redis_url: str, load, **options) -> tuple[ServerThread, CanaryOptions]:
    canary = CanaryOptions(arms=ARMS, deployment="gw-" + uuid.uuid4().hex[:8], **options)
    server = ServerThread(load, sessions=open_session_store(redis_url), arm_routers=CanaryArms(canary, redis_url))
    return server, canary


def generate(client: TandemClient, prompt: list[int], session_id: str) -> list[int]:
    items = list(client.generate(token_ids=prompt, session_id=session_id, **GREEDY))
    assert isinstance(items[-1], pb.Complete)
    return [t for item in items[:-1] for t in item.token_ids]


def prompt_for(i: int) -> list[int]:
    return [(31 * i + 7 * j) % 250 + 3 for j in range(4 + i % 7)]


@pytest.fixture(scope="module")
def plain(tiny_models):
    engine = build_engine(tiny_models[0], None, CONFIG)
    params = SamplingParams(**GREEDY)
    return lambda prompt: engine.generate([prompt], params)[0].token_ids


def test_sessions_stick_to_weighted_arms(redis_server, tiny_models, plain) -> None:
    target, draft, draft_random = tiny_models
    server, canary = start(redis_server.url, arms_loader(target, draft, draft_random),
                           thresholds=Thresholds(min_sessions=10_000), greedy_check_rate=0.0)
    sessions = [f"user-{i}" for i in range(30)]
    try:
        assert set(server.gateway.loops) == {"stable", "canary"}
        with TandemClient(server.address, timeout=60) as client:
            for turn in range(2):  # every session twice: the repeat must land on the same arm
                for i, session in enumerate(sessions):
                    tokens = generate(client, prompt_for(i), session)
                    if turn == 0 and i % 5 == 0:
                        assert tokens == plain(prompt_for(i))
        controller = server.gateway.arm_router.controller
        controller.flush()
        state = controller.state(refresh=True)
        store = RedisCanaryStore(redis_server.url)
        seen = {arm: Counter(o.session for o in store.outcomes(canary.deployment, state.generation, arm, 2000))
                for arm in ("stable", "canary")}
    finally:
        server.stop()
    assert state.weights == {"stable": 50.0, "canary": 50.0}
    for session in sessions:
        key = short_hash(session_key(session, ""))
        placed = [arm for arm, counts in seen.items() if counts[key]]
        assert len(placed) == 1 and seen[placed[0]][key] == 2, (session, seen)
    per_arm = {arm: len(counts) for arm, counts in seen.items()}
    assert sum(per_arm.values()) == 30 and min(per_arm.values()) >= 6, per_arm  # 50/50: both arms well used


def test_tenants_key_the_assignment_and_are_recorded(redis_server, tiny_models, tmp_path) -> None:
    target, draft, draft_random = tiny_models
    path = tmp_path / "keys.jsonl"
    keys = {tenant: create_key(path, tenant) for tenant in ("alice", "bob")}
    canary = CanaryOptions(arms=ARMS, deployment="gw-" + uuid.uuid4().hex[:8], greedy_check_rate=0.0,
                           thresholds=Thresholds(min_sessions=10_000))
    server = ServerThread(arms_loader(target, draft, draft_random), sessions=open_session_store(redis_server.url),
                          arm_routers=CanaryArms(canary, redis_server.url), api_keys=ApiKeys.load(path))
    sessions = [f"s{i}" for i in range(6)]
    try:
        for key in keys.values():  # the same session ids in both tenants
            with TandemClient(server.address, timeout=60, api_key=key) as client:
                for i, session in enumerate(sessions):
                    items = list(client.generate(token_ids=prompt_for(i), session_id=session, max_tokens=4,
                                                 temperature=0.0, ignore_eos=True))
                    assert isinstance(items[-1], pb.Complete)
        controller = server.gateway.arm_router.controller
        controller.flush()
        generation = controller.state(refresh=True).generation
        store = RedisCanaryStore(redis_server.url)
        seen = {arm: {o.session: o for o in store.outcomes(canary.deployment, generation, arm, 2000)}
                for arm in ("stable", "canary")}
        for tenant in keys:
            for session in sessions:
                scoped = scoped_id(tenant, session)  # the gateway's id for it
                arm = controller.arm_for(scoped, tenant=tenant).arm.name
                outcome = seen[arm].get(short_hash(session_key(scoped, "", tenant)))
                assert outcome is not None and outcome.tenant == tenant, (tenant, session, arm, seen)
    finally:
        server.stop()
    assert sum(len(window) for window in seen.values()) == 12


def test_random_draft_canary_rolled_back_through_grpc(redis_server, tiny_models, plain) -> None:
    target, draft, draft_random = tiny_models
    thresholds = Thresholds(min_sessions=8, max_acceptance_drop=0.2, max_tpot_p50_ratio=2.0, max_tpot_p99_ratio=20.0)
    server, canary = start(redis_server.url, arms_loader(target, draft, draft_random), thresholds=thresholds,
                           greedy_check_rate=1.0, greedy_check_tokens=NEW_TOKENS, decide_interval_s=0.3,
                           cache_ttl_s=0.2)
    store = RedisCanaryStore(redis_server.url)
    outputs: dict[str, list[tuple[list[int], list[int]]]] = {"stable": [], "canary": []}
    try:
        controller = server.gateway.arm_router.controller
        with TandemClient(server.address, timeout=60) as client:
            deadline = time.monotonic() + 25
            i = 0
            while time.monotonic() < deadline:
                state = store.load(canary.deployment)  # what `tandem canary status` reads
                if state.status != "running":
                    break
                session = f"s-{i}"
                arm = controller.arm_for(session).arm.name
                prompt = prompt_for(i)
                outputs[arm].append((prompt, generate(client, prompt, session)))
                i += 1
        metrics = controller.metrics()["arms"]
    finally:
        server.stop()
    state = store.load(canary.deployment)
    assert state.status == ROLLED_BACK and state.weights == {"stable": 100.0, "canary": 0.0}, state.log
    record = state.log[-1]
    assert (record.action, record.arm, record.source, record.code) == ("rollback", "canary", "auto", "acceptance_drop")
    assert metrics["canary"]["accepted"] / metrics["canary"]["drafted"] < 0.2
    assert metrics["stable"]["accepted"] / metrics["stable"]["drafted"] > 0.4
    assert metrics["canary"]["greedy_mismatches"] == 0  # a bad draft is slow, never wrong
    for arm in ("stable", "canary"):
        assert outputs[arm], arm
        for prompt, tokens in outputs[arm][:6]:
            assert tokens == plain(prompt), arm
