"""Request ids across gateway replicas (gateway.request_registry), on a real redis-server: two gateways with the tiny
pair share one Redis; an Abort sent to the replica not running a request stops it there, an id running on one replica
is refused on the other and free once it ended, tenants' ids stay apart, a tenant's cap holds across the replicas;
the registry's keys expire after a dead gateway, survive a release that reaches Redis late, and come back after an
outage."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import redis as redis_client

from gateway_harness import ServerThread, tiny_backend
from tandem.client import TandemClient
from tandem.gateway.auth import ApiKeys, create_key
from tandem.gateway.request_registry import KEY_PREFIX, Claim, RedisRequestRegistry
from tandem.sessions import EmbeddedRedis, open_session_store
from tandem.v1 import generation_pb2 as pb

LONG = {"temperature": 0.0, "max_tokens": 4000, "ignore_eos": True}


@pytest.fixture(scope="module")
def redis_server():
    with EmbeddedRedis() as embedded:
        yield embedded


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys"
    alice, bob = create_key(path, "alice"), create_key(path, "bob")
    carol = create_key(path, "carol", max_concurrency=1)
    return alice, bob, ApiKeys.load(path), carol


@pytest.fixture(scope="module")
def gateways(tiny_models, redis_server, keys):
    target, draft, _ = tiny_models
    pair = [ServerThread(tiny_backend(target, draft), sessions=open_session_store(redis_server.url),
                         api_keys=keys[2]) for _ in range(2)]
    yield pair
    for server in pair:
        server.stop()


def running(client: TandemClient, request_id: str):
    stream = client.generate(token_ids=[5, 6, 7, 8], request_id=request_id, **LONG)
    assert isinstance(next(stream), pb.Chunk)
    return stream


def test_an_abort_sent_to_the_other_gateway_stops_the_request(gateways, keys) -> None:
    first, second = gateways
    with TandemClient(first.address, api_key=keys[0], timeout=60) as here, \
            TandemClient(second.address, api_key=keys[0], timeout=60) as there:
        stream = running(here, "cross")
        assert there.abort("cross") is True
        complete = next(item for item in stream if isinstance(item, pb.Complete))
        assert complete.finish_reason == pb.FINISH_REASON_ABORT and complete.usage.completion_tokens < 4000
        # Its id was freed before the client heard the request ended: nothing runs it anywhere now, and the other
        # replica takes it at once.
        assert there.abort("cross") is False and here.abort("cross") is False
        assert there.generate_text(token_ids=[1, 2], request_id="cross", max_tokens=2, temperature=0.0)
        assert there.abort("never-ran") is False


def test_an_id_running_on_one_gateway_is_refused_on_the_other_until_it_ends(gateways, keys) -> None:
    first, second = gateways
    with TandemClient(first.address, api_key=keys[0], timeout=60) as here, \
            TandemClient(second.address, api_key=keys[0], timeout=60) as there, \
            TandemClient(second.address, api_key=keys[1], timeout=60) as other_tenant:
        stream = running(here, "taken")
        with pytest.raises(grpc.RpcError) as caught:
            there.generate_text(token_ids=[1, 2], request_id="taken", max_tokens=2)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "request_id: 'taken' is already running" in caught.value.details()
        # Another tenant's same id is another request: it runs, and its Abort cannot reach alice's.
        assert other_tenant.generate_text(token_ids=[1, 2], request_id="taken", max_tokens=2, temperature=0.0)
        assert other_tenant.abort("taken") is False
        stream.close()
        assert first.wait_for(lambda: first.gateway.loop.active == 0)
        assert second.wait_for(lambda: there.generate_text(token_ids=[1, 2], request_id="taken", max_tokens=2,
                                                           temperature=0.0) != "", timeout=5)


def test_an_id_taken_again_at_once_on_one_gateway_keeps_its_claim(gateways, keys, redis_server) -> None:
    first, _ = gateways
    raw = redis_client.Redis.from_url(redis_server.url, decode_responses=True)
    with TandemClient(first.address, api_key=keys[0], timeout=60) as here:
        for _ in range(5):  # each release races the next claim of the same id on the same replica
            assert here.generate_text(token_ids=[1, 2], request_id="again", max_tokens=2, temperature=0.0)
        stream = running(here, "again")
        assert raw.get(f"{KEY_PREFIX}alice:again").startswith(first.gateway.generations.registry.gateway_id)
        stream.close()
    assert first.wait_for(lambda: raw.get(f"{KEY_PREFIX}alice:again") is None)


def registry_run(url: str, work, ttl_s: float = 30.0):
    async def run():
        registry = RedisRequestRegistry(url, ttl_s=ttl_s)
        aborted: list[str] = []
        await registry.start(lambda request_id: aborted.append(request_id) is None)
        try:
            return await work(registry, aborted)
        finally:
            await registry.close()

    return asyncio.run(run())


def test_keys_outlive_their_ttl_while_renewed_and_a_dead_gateways_expire(redis_server, monkeypatch) -> None:
    monkeypatch.setattr("tandem.gateway.request_registry.RENEW_S", 0.2)
    raw = redis_client.Redis.from_url(redis_server.url, decode_responses=True)

    async def work(registry, _):
        dead = RedisRequestRegistry(redis_server.url, ttl_s=0.6)  # never listens nor renews, as if killed
        assert {await registry.claim("renewed"), await dead.claim("dead"), await dead.claim("retried")} == {Claim.TAKEN}
        assert await registry.claim("retried") is Claim.TAKEN  # its owner gone: the client's retry runs at once
        await asyncio.sleep(1.5)
        await dead._client.aclose()
        return [raw.exists(KEY_PREFIX + name) for name in ("renewed", "dead", "retried")]

    assert registry_run(redis_server.url, work, ttl_s=0.6) == [1, 0, 1]
    assert not raw.exists(KEY_PREFIX + "renewed")  # closed: its ids are free at once


def test_through_an_outage_ids_are_checked_here_and_registered_once_redis_is_back(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr("tandem.gateway.request_registry.RENEW_S", 0.2)
    monkeypatch.setattr("tandem.gateway.request_registry.RETRY_S", (0.1, 0.2))
    monkeypatch.setattr("tandem.gateway.request_registry.LISTEN_POLL_S", 0.1)
    server = EmbeddedRedis().start()
    try:
        async def work(registry, aborted):
            other = RedisRequestRegistry(server.url)
            await other.start(lambda request_id: False)
            assert await other.claim("before") is Claim.TAKEN
            await asyncio.wait_for(registry.listening.wait(), 5)
            assert await other.abort_elsewhere("x") is False  # nobody holds it
            assert await registry.claim("mine") is Claim.TAKEN and await other.abort_elsewhere("mine") is True
            await wait_until(lambda: aborted == ["mine"])
            server.stop()
            started = time.monotonic()
            assert await registry.claim("during") is Claim.TAKEN  # unchecked: Redis cannot say
            assert await registry.abort_elsewhere("before") is False
            assert time.monotonic() - started < 1.0
            server.start()
            raw = redis_client.Redis.from_url(server.url, decode_responses=True)
            await wait_until(lambda: raw.exists(KEY_PREFIX + "during") and registry.listening.is_set())
            assert await other.abort_elsewhere("during") is True
            await wait_until(lambda: aborted == ["mine", "during"])
            await other.close()

        registry_run(server.url, work)
    finally:
        server.stop()


async def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_a_tenants_cap_holds_across_the_replicas(gateways, keys) -> None:
    first, second = gateways
    with TandemClient(first.address, api_key=keys[3], timeout=60) as here, \
            TandemClient(second.address, api_key=keys[3], timeout=60) as there:
        stream = running(here, "one")
        with pytest.raises(grpc.RpcError) as caught:
            there.generate_text(token_ids=[1, 2], max_tokens=2)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "tenant 'carol' has 1 requests queued or running on the gateway replicas together" in \
            caught.value.details()
        stream.close()
        assert second.wait_for(lambda: _runs(there), timeout=10)


def _runs(client: TandemClient) -> bool:
    try:
        return bool(client.generate_text(token_ids=[1, 2], max_tokens=2, temperature=0.0))
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
        return False


def test_a_dead_gateways_requests_do_not_count_against_a_tenants_cap(redis_server) -> None:
    async def work(registry, _):
        dead = RedisRequestRegistry(redis_server.url)  # never listens, as if killed
        assert await dead.claim("dana:a", "dana", 1) is Claim.TAKEN
        assert await registry.claim("dana:b", "dana", 1) is Claim.TAKEN
        assert await registry.claim("dana:c", "dana", 1) is Claim.TENANT_BUSY
        assert await registry.claim("dana:c", "dana", 2) is Claim.TAKEN  # (a cap is the caller's, per claim)
        await registry.release("dana:b")
        await registry.release("dana:c")
        assert await registry.claim("dana:d", "dana", 1) is Claim.TAKEN
        await dead._client.aclose()

    registry_run(redis_server.url, work)
