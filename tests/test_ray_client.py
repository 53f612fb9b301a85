"""Ray Client mode: `tandem gateway` joined to the cluster as a Ray Client (ray://HOST:PORT, the Helm chart's
gateway.joinRayCluster=false) over pools that `tandem pools start` put on a real head (`ray start --head`, token
authentication on), beside a gateway that joined on the GCS address as a driver, sharing the same workers."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")

import grpc

from pools_harness import (
    BIN,
    PROMPTS,
    RAY_TOKEN_FILE,
    Gateway,
    assert_workers_kept,
    at_once,
    expected_fixture,  # noqa: F401 (the expected fixture)
    head_env,
    named_actors,
    pool_status,
    ray_client_address,
    ray_head,
    tandem_cli,
    wait_sequences_released,
)
from tandem import ray_auth
from tandem.bench.local_cluster import free_port
from tandem.client import TandemClient
from tandem.sessions import EmbeddedRedis

# A refused token fails the gateway within this: Ray Client alone takes about 50 s to report it (tandem.ray_auth).
REFUSED_S = 40
# A killed Ray Client gateway's job (its proxy on the head) ends after Ray Client's reconnect grace period (30 s by
# default) and the proxy's idle checks; the workers look for dead jobs every 10 s.
ORPHANS_RELEASED_S = 180
LIVE_JOBS = ("import json, ray; from ray._private import state; ray.init(log_to_driver=False); "
             "print(json.dumps([[j['DriverPid'], j['Entrypoint']] for j in state.jobs() if not j['IsDead']]))")


@pytest.fixture(scope="module")
def client_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def ray_temp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ray")


@pytest.fixture(scope="module")
def cluster(ray_temp, client_port):
    with ray_head(ray_temp, client_port=client_port) as address:
        yield address


def _client_server_logs(ray_temp: Path) -> str:
    """The tails of the head's Ray Client session-server logs (ray_client_server_PORT.err): why one died."""
    logs = sorted((ray_temp / "session_latest" / "logs").glob("ray_client_server_*.err"))
    return "\n".join(f"{log.name}: {log.read_text()[-600:]}" for log in logs)


@pytest.fixture(scope="module")
def pools(cluster, tiny_dirs):
    tandem_cli(cluster, "pools", "start", "--name", "t", "--target", str(tiny_dirs.target), "--draft",
               str(tiny_dirs.draft), "--threads", "1", "--dtype", "float32", "--fixed-k", "4",
               "--batch-window-ms", "50")
    yield cluster
    tandem_cli(cluster, "pools", "stop", "--name", "t")


@pytest.fixture(scope="module")
def redis():
    with EmbeddedRedis() as server:
        yield server


def _client_env(token: str | None = None) -> dict:
    """The token as the chart passes it to a gateway (RAY_AUTH_TOKEN, from a Secret; Ray prefers it over the file
    head_env names): the head's unless `token`."""
    return {"RAY_AUTH_TOKEN": token or Path(RAY_TOKEN_FILE).read_text().strip()}


@pytest.fixture(scope="module")
def gateways(pools, client_port, redis, tmp_path_factory):
    """[a gateway joined as a Ray Client, one joined on the GCS address]: readiness SERVING once each is built."""
    logs = tmp_path_factory.mktemp("gateways")
    started: list[Gateway] = []
    try:
        started.append(Gateway(ray_client_address(client_port), redis.url, env=_client_env(),
                               log=logs / "client.err"))
        started.append(Gateway(pools, redis.url, log=logs / "driver.err"))
        yield started
    finally:
        for gateway in started:
            if gateway.process.poll() is None:
                gateway.stop()


def _live_jobs(address: str) -> list[tuple[int, str]]:
    """The cluster's live Ray jobs: (driver pid, entrypoint)."""
    done = subprocess.run([sys.executable, "-c", LIVE_JOBS], env=head_env(address), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return [tuple(job) for job in json.loads(done.stdout.strip().splitlines()[-1])]


def test_a_ray_client_gateway_decodes_exactly_beside_a_driver_gateway_on_one_pool(pools, client_port, gateways,
                                                                                   expected) -> None:
    client, driver = gateways
    # Really a Ray Client: its job's driver is Ray Client's proxy on the head, not the gateway's process.
    jobs = _live_jobs(pools)
    assert client.process.pid not in {pid for pid, _ in jobs}, jobs
    assert any("ray.util.client.server" in entry for _, entry in jobs), jobs
    assert driver.process.pid in {pid for pid, _ in jobs}, jobs
    # Every prompt at once through the client gateway alone, then through both gateways at once.
    out = at_once([(client.address, i) for i in range(len(PROMPTS))])
    assert [out[(i, i)] for i in range(len(PROMPTS))] == expected
    out = at_once([(gateway.address, i) for i in range(len(PROMPTS)) for gateway in gateways])
    assert {key: ids for key, ids in out.items()} == {(n, n // 2): expected[n // 2] for n in range(2 * len(PROMPTS))}
    # The pool's workers answer the client gateway's own Ray calls (model info sums their KV caches).
    with TandemClient(client.address, timeout=30) as grpc_client:
        info = grpc_client.model_info()
    assert (info.draft_workers, info.target_replicas) == (1, 1)
    assert info.target_kv.capacity_tokens > 0 and info.draft_kv.capacity_tokens > 0
    # `tandem pools status` joins through the Ray Client server as well.
    via_client = json.loads(tandem_cli(ray_client_address(client_port), "pools", "status", "--name", "t", "--json"))
    assert sorted(w["name"] for w in via_client["workers"]) == ["draft-0", "target-0"]
    names, cpus_used = named_actors(pools)
    assert names == ["tandem-pools-t", "tandem-pools-t-draft-0", "tandem-pools-t-target-0"]
    assert cpus_used == 2  # the workers' alone: neither gateway holds a CPU (nor does the client's proxy)


def test_a_ray_client_gateway_with_another_token_is_refused_at_once(pools, client_port, redis) -> None:
    """Ray Client retries a refused token as a server not up yet and then says "ray client connection timeout":
    tandem asks the server first and names the refusal."""
    done = subprocess.run([str(BIN / "tandem"), "gateway", "--pools", "t", "--port", "0", "--metrics-port", "-1",
                           "--redis-url", redis.url],
                          env=head_env(ray_client_address(client_port)) | _client_env("0" * 64),
                          capture_output=True, text=True, timeout=REFUSED_S)
    assert done.returncode == 2, done.stderr[-2000:]
    assert (f"the Ray cluster at {ray_client_address(client_port)} refused this client (the token is not the "
            "cluster's)") in done.stderr, done.stderr[-2000:]


# join_cluster over Ray Client where the proxy's first server for this client dies at birth (as one did in CI:
# "Initialization failure from server"): the failure is planted in front of the real ray.init, once.
FAILS_ONCE = """
import json, logging, sys
import ray
from tandem import ray_auth
real, calls = ray.init, []
def init(*args, **kwargs):
    calls.append(1)
    if len(calls) == 1:
        raise ConnectionAbortedError("Initialization failure from server:\\npsutil.ZombieProcess: (pid=1)")
    return real(*args, **kwargs)
ray.init = init
logging.basicConfig(level=logging.WARNING)
ray_auth.join_cluster(sys.argv[1])
print(json.dumps({"calls": len(calls), "nodes": len(ray.nodes())}))
ray.shutdown()
"""


def test_a_ray_client_session_that_fails_to_start_is_tried_again(pools, client_port, ray_temp) -> None:
    done = subprocess.run([sys.executable, "-c", FAILS_ONCE, ray_client_address(client_port)],
                          env=head_env(ray_client_address(client_port)) | _client_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, (done.stderr[-2000:], _client_server_logs(ray_temp))
    joined = json.loads(done.stdout.strip().splitlines()[-1])
    # The planted failure, then the real ray.init: 2 calls, or more where the proxy's next servers died at birth as
    # well (one did, and in CI two in a row, after the gateways' sessions on this head).
    assert joined["nodes"] == 1 and 2 <= joined["calls"] <= ray_auth.CLIENT_STARTS, (joined, done.stderr[-2000:])
    assert f"failed to start this client's session (try 1 of {ray_auth.CLIENT_STARTS})" in done.stderr


def test_a_ray_client_gateway_stops_cleanly_and_releases_its_sequences(pools, client_port, redis, expected,
                                                                       tmp_path) -> None:
    gateway = Gateway(ray_client_address(client_port), redis.url, env=_client_env(), log=tmp_path / "client.err")
    try:
        assert at_once([(gateway.address, 0)])[(0, 0)] == expected[0]
    finally:
        gateway.stop()
    assert gateway.process.returncode == 0, (tmp_path / "client.err").read_text()[-2000:]
    assert not any(w["sequences"] for w in pool_status(pools)["workers"])


def test_a_killed_ray_client_gateway_leaves_the_other_serving_and_its_sequences_are_released(
        pools, gateways, expected) -> None:
    """Wire ids start with the gateway's Ray job (workers.orphans): for a Ray Client that is its proxy's job on the
    head, which Ray ends once the client is gone for good."""
    client, driver = gateways
    pids = {w["name"]: w["pid"] for w in pool_status(pools)["workers"]}
    out: dict = {}
    killed: dict = {}
    runners = [threading.Thread(target=lambda: out.update(at_once([(driver.address, i) for i in range(4)]))),
               threading.Thread(target=lambda: killed.update(at_once([(client.address, i) for i in range(4)],
                                                                     tokens=400, ids="k")))]
    for runner in runners:
        runner.start()
    time.sleep(1.0)
    client.stop(signal.SIGKILL)
    for runner in runners:
        runner.join(timeout=300)
    assert [out[(i, i)] for i in range(4)] == expected
    assert all(isinstance(result, grpc.RpcError) for result in killed.values()), killed
    assert_workers_kept(pools, pids)
    wait_sequences_released(pools, ORPHANS_RELEASED_S)
