"""The whole distributed stack: gRPC gateway, Ray draft workers and target replicas, sessions in a real Redis."""

from __future__ import annotations

import os
import signal
import time

import pytest

ray = pytest.importorskip("ray")

from gateway_harness import ServerThread  # noqa: E402
from tandem.client import TandemClient  # noqa: E402
from tandem.core.config import EngineConfig, SamplingParams, SpecConfig  # noqa: E402
from tandem.engines import Arm, BuildOptions, ClusterOptions, build  # noqa: E402
from tandem.engines.local import build_engine  # noqa: E402
from tandem.sessions import EmbeddedRedis, RedisSessionStore  # noqa: E402

PROMPTS = [[72, 101, 108, 108, 111, 32, 119], [40, 50, 60], [1, 2, 3, 4, 5, 6, 7, 8, 9], [200, 17], [99] * 12,
           [33, 34, 35, 36], [120, 121], [5, 250, 8, 80, 13]]
TOKENS = 40


@pytest.fixture(scope="module")
def stack(tiny_dirs, ray_session):
    # A restart mid-module (below) once ran past the 10-s default while the other xdist worker compiled: it starts in
    # 20 ms on a quiet machine, and the test is of the gateway's outage, not of redis-server's start under load.
    redis = EmbeddedRedis(start_timeout_s=60)
    redis.start()
    store = RedisSessionStore(redis.url, retry_initial_s=0.1)
    config = EngineConfig(spec=SpecConfig(adaptive=False, k_init=4), calibrate=False)
    options = ClusterOptions(draft_workers=2, target_replicas=1, threads=1, dtype="float32")
    backend = build(BuildOptions(str(tiny_dirs.target), (Arm("", str(tiny_dirs.draft), config),), options))[""]
    server = ServerThread(lambda: backend, sessions=store)
    yield server, backend, redis, store
    server.stop()
    for worker in backend.engine.drafter.workers + backend.engine.verifier.workers:
        ray.kill(worker)
    redis.stop()


@pytest.fixture(scope="module")
def expected(tiny_models):
    greedy = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    return [r.token_ids for r in build_engine(tiny_models[0], None).generate(PROMPTS, greedy)]


def _generate(address: str, prompt: list[int], **options) -> list[int]:
    with TandemClient(address, timeout=120) as client:
        ids = []
        for item in client.generate(token_ids=prompt, temperature=0.0, max_tokens=TOKENS, ignore_eos=True,
                                    **options):
            ids += list(getattr(item, "token_ids", []))
    return ids


def _worker_caches(backend) -> list[int] | None:
    """Cached sequences per worker; None while a worker is restarting."""
    workers = backend.engine.drafter.workers + backend.engine.verifier.workers
    try:
        return ray.get([w.cached_sequences.remote() for w in workers], timeout=30)
    except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
        return None


def test_served_greedy_equals_in_process_plain_decoding(stack, expected) -> None:
    server, backend, _, store = stack
    outputs = [_generate(server.address, p, session_id=f"s{i}") for i, p in enumerate(PROMPTS)]
    assert outputs == expected
    assert store.get("s0") is not None, "the session's policy state should be in Redis"
    with TandemClient(server.address, timeout=30) as client:
        info = client.model_info()
    assert (info.draft_workers, info.target_replicas, info.tensor_parallel_size) == (2, 1, 1)
    assert server.wait_for(lambda: _worker_caches(backend) == [0, 0, 0])


def test_draft_workers_killed_mid_stream_leave_output_identical(stack, expected) -> None:
    server, backend, _, _ = stack
    pids = ray.get([w.info.remote() for w in backend.engine.drafter.workers])
    with TandemClient(server.address, timeout=120) as client:
        stream = client.generate(token_ids=PROMPTS[0], temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
        ids = list(next(stream).token_ids)
        for info in pids:
            os.kill(info["pid"], signal.SIGKILL)
        for item in stream:
            ids += list(getattr(item, "token_ids", []))
            final = item
    assert ids == expected[0]
    assert final.speculation.draft_failures >= 1
    assert final.finish_reason == 2  # LENGTH: no client-visible error


def test_redis_stopped_mid_run_keeps_serving(stack, expected) -> None:
    server, _, redis, store = stack
    redis.stop()
    try:
        assert _generate(server.address, PROMPTS[1], session_id="during-outage") == expected[1]
        assert store.counters.redis_errors >= 1
    finally:
        redis.start()
    time.sleep(0.3)
    assert _generate(server.address, PROMPTS[2], session_id="after-outage") == expected[2]
    assert server.wait_for(lambda: store.get("after-outage") is not None and store.healthy, timeout=10)


def test_cancellation_frees_worker_caches(stack) -> None:
    server, backend, _, _ = stack
    with TandemClient(server.address, timeout=120) as client:
        stream = client.generate(token_ids=PROMPTS[3], temperature=0.0, max_tokens=400, ignore_eos=True)
        next(stream)
        next(stream)
        stream.close()  # cancels the call
    assert server.wait_for(lambda: not backend.engine.sequences and _worker_caches(backend) == [0, 0, 0],
                           timeout=60)


def test_a_sessions_turns_reuse_the_workers_cache_and_affinity_is_stored(stack, tiny_models) -> None:
    server, backend, _, store = stack
    engine = backend.engine
    router = engine.drafter.router
    # Earlier tests killed draft workers: wait until they are back in service.
    assert server.wait_for(lambda: all(router.healthy(i) for i in range(router.size))
                           and _worker_caches(backend) is not None, timeout=60)
    first = _generate(server.address, PROMPTS[5], session_id="chat")
    assert server.wait_for(lambda: (store.get("chat") or {}).keys() >= {"draft_worker", "target_replica"})
    saved = store.get("chat")
    draft_worker = engine.drafter.router.sessions["chat"]
    # Stored by name: an index would point elsewhere once the pool's set of workers changes.
    assert saved["draft_worker"] == f"draft-{draft_worker}" and saved["target_replica"] == "target-0"
    before = ray.get([w.info.remote() for w in engine.drafter.workers + engine.verifier.workers])
    second_prompt = PROMPTS[5] + first + [7, 8, 9]
    plain = build_engine(tiny_models[0], None)
    want = plain.generate([second_prompt], SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True))
    assert _generate(server.address, second_prompt, session_id="chat") == want[0].token_ids
    after = ray.get([w.info.remote() for w in engine.drafter.workers + engine.verifier.workers])
    reused = [a["reused_tokens"] - b["reused_tokens"] for a, b in zip(after, before, strict=True)]
    assert reused[draft_worker] >= len(PROMPTS[5]), reused
    assert reused[-1] >= len(PROMPTS[5]) + TOKENS - 1, reused  # the target had both prompt and answer cached
    # A gateway that has never seen the session (a restart, another replica) routes it from the stored affinity.
    engine.drafter.router.sessions.clear()
    engine.pin_session("chat", store.get("chat"))
    assert engine.drafter.router.sessions["chat"] == draft_worker


def test_canary_arms_share_the_target_pool_and_each_draft_model_gets_its_own(tiny_dirs, ray_session,
                                                                              expected) -> None:
    config = EngineConfig(spec=SpecConfig(adaptive=False, k_init=4), calibrate=False)
    options = ClusterOptions(draft_workers=1, target_replicas=1, threads=1, dtype="float32")
    arms = (Arm("stable", str(tiny_dirs.draft), config), Arm("canary", str(tiny_dirs.draft_random), config),
            Arm("again", str(tiny_dirs.draft), config), Arm("plain", "", config))
    backends = build(BuildOptions(str(tiny_dirs.target), arms, options))
    assert list(backends) == ["stable", "canary", "again", "plain"]
    try:
        targets = {b.engine.verifier.workers[0]._actor_id for b in backends.values()}
        assert len(targets) == 1, "every arm verifies on the one target pool"
        drafts = {name: b.engine.drafter.workers[0]._actor_id for name, b in backends.items() if b.engine.drafter}
        assert drafts.keys() == {"stable", "canary", "again"}
        assert drafts["stable"] == drafts["again"] != drafts["canary"], "one draft pool per draft model"
        greedy = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
        for backend in backends.values():
            assert [r.token_ids for r in backend.engine.generate(PROMPTS[:3], greedy)] == expected[:3]
    finally:
        actors = {a._actor_id: a for b in backends.values() for side in (b.engine.drafter, b.engine.verifier)
                  if side is not None for a in side.actors()}
        for actor in actors.values():
            ray.kill(actor)
