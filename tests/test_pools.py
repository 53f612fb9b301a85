"""Shared pools: `tandem pools` on a real Ray cluster (`ray start --head`), separate `tandem gateway` processes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")

import grpc

from tandem.client import TandemClient
from tandem.core.config import SamplingParams
from tandem.local_engine import build_engine
from tandem.sessions import EmbeddedRedis

TOKENS = 40
PROMPTS = [[5, 6, 7, 8], [40, 50, 60], [1, 2, 3, 4, 5, 6, 7], [200, 17, 33]]
BIN = Path(sys.executable).parent
SERVING, NOT_SERVING = 1, 2  # grpc.health.v1
READINESS = "tandem.v1.Generation"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env(address: str) -> dict:
    # Not this process's own Ray settings (a local Ray started here turns token auth on): the loopback head has none.
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return inherited | {"RAY_ADDRESS": address, "RAY_AUTH_MODE": "disabled",
                        "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                         "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}


def _tandem(address: str, *args: str, timeout: float = 180) -> str:
    done = subprocess.run([str(BIN / "tandem"), *args], env=_env(address), capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A Ray head on loopback, apart from the test process's own Ray; the pools `t` on it (tiny models). Started with
    --block so that stopping it stops this head alone (`ray stop` would stop every Ray on the machine)."""
    if shutil.which("ray", path=str(BIN)) is None:
        pytest.skip("no ray command")
    port, temp = _free_port(), tmp_path_factory.mktemp("ray")
    address = f"127.0.0.1:{port}"
    head = subprocess.Popen([str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
                             f"--port={port}", "--num-cpus=8", "--include-dashboard=false", "--disable-usage-stats",
                             f"--temp-dir={temp}"], env=_env(address), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert head.poll() is None and time.monotonic() < deadline, "the Ray head did not start"
            time.sleep(0.2)
    yield address
    head.terminate()
    head.wait(timeout=120)


@pytest.fixture(scope="module")
def pools(cluster, tiny_dirs):
    _tandem(cluster, "pools", "start", "--name", "t", "--target", str(tiny_dirs.target), "--draft",
            str(tiny_dirs.draft), "--threads", "1", "--dtype", "float32", "--fixed-k", "4",
            "--batch-window-ms", "50")  # tiny forwards take well under a millisecond: a window calls surely share
    yield cluster
    _tandem(cluster, "pools", "stop", "--name", "t")


class Gateway:
    def __init__(self, address: str, redis_url: str, *flags: str) -> None:
        self.process = subprocess.Popen([str(BIN / "tandem"), "gateway", "--pools", "t", "--port", "0",
                                         "--metrics-port", "-1", "--redis-url", redis_url, *flags],
                                        env=_env(address), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        for line in self.process.stdout:
            if "serving tandem.v1.Generation on" in line:
                self.address = line.split(" on ")[1].split()[0]
                break
        else:
            raise AssertionError("the gateway exited before listening")
        threading.Thread(target=self.process.stdout.read, daemon=True).start()
        deadline = time.monotonic() + 120
        with TandemClient(self.address, timeout=10) as client:
            while client.health_status("tandem.v1.Generation") != SERVING:
                assert time.monotonic() < deadline, "the gateway never turned ready"
                time.sleep(0.2)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.process.send_signal(sig)
        self.process.wait(timeout=60)


@pytest.fixture(scope="module")
def gateways(pools):
    """Two gateway processes sharing the pools and one Redis (the session store every gateway of a deployment uses)."""
    with EmbeddedRedis() as redis:
        started = [Gateway(pools, redis.url), Gateway(pools, redis.url)]
        yield started
        for gateway in started:
            if gateway.process.poll() is None:
                gateway.stop()


@pytest.fixture(scope="module")
def expected(tiny_models):
    greedy = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    return [r.token_ids for r in build_engine(tiny_models[0], None).generate(PROMPTS, greedy)]


def _generate(address: str, prompt: list[int], out: dict, key, request_id: str) -> None:
    with TandemClient(address, timeout=120) as client:
        ids = []
        for item in client.generate(token_ids=prompt, temperature=0.0, max_tokens=TOKENS, ignore_eos=True,
                                    request_id=request_id):
            ids += list(getattr(item, "token_ids", []))
        out[key] = ids


def _at_once(jobs: list[tuple[str, int]], pair_ids: bool = True) -> dict:
    """With `pair_ids`, job n runs as request id `r{n // 2}`: jobs alternating between two gateways give each gateway
    the same ids."""
    out: dict = {}
    threads = [threading.Thread(target=_generate, args=(address, PROMPTS[i], out, (n, i),
                                                        f"r{n // 2 if pair_ids else n}"))
               for n, (address, i) in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    return out


def _status(address: str) -> dict:
    return json.loads(_tandem(address, "pools", "status", "--name", "t", "--json"))


def test_two_gateways_share_one_pool_and_batch_across_gateways(pools, gateways, expected) -> None:
    before = {w["name"]: w["merged_forwards"] for w in _status(pools)["workers"]}
    # The same request id on both gateways at once: each gateway's ids are kept apart on the shared workers.
    out = _at_once([(gateways[0].address, 0), (gateways[1].address, 1)] * 2)
    assert {key: ids for key, ids in out.items()} == {(n, i): expected[i] for n, i in [(0, 0), (1, 1), (2, 0),
                                                                                        (3, 1)]}
    status = _status(pools)
    assert sorted(w["role"] for w in status["workers"]) == ["draft", "target"]
    assert all(w["healthy"] for w in status["workers"])
    target = next(w for w in status["workers"] if w["role"] == "target")
    assert target["merged_forwards"] > before["target-0"], "no verify forward served both gateways"
    assert status["rows_per_verify_call"] > 1


def test_worker_actors_are_the_pools_alone(pools, gateways) -> None:
    """Two gateways attached, yet the cluster holds one draft worker and one target replica: the named workers, and
    the CPUs in use (each worker asks for one; the manager and the gateways' drivers for none)."""
    script = ("import ray, json; ray.init(log_to_driver=False, namespace='tandem'); "
              "names = sorted(a['name'] for a in ray.util.list_named_actors(all_namespaces=True)); "
              "used = ray.cluster_resources()['CPU'] - ray.available_resources().get('CPU', 0); "
              "print(json.dumps([names, used]))")
    done = subprocess.run([sys.executable, "-c", script], env=_env(pools), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    names, cpus_used = json.loads(done.stdout.strip().splitlines()[-1])
    assert names == ["tandem-pools-t", "tandem-pools-t-draft-0", "tandem-pools-t-target-0"]
    assert cpus_used == 2


def test_scaling_under_load_fails_nothing(pools, gateways, expected) -> None:
    rounds: list[dict] = []
    scaled = threading.Event()
    jobs = [(gateways[n % 2].address, n % len(PROMPTS)) for n in range(8)]

    def load() -> None:
        while not scaled.is_set() or not rounds:
            rounds.append(_at_once(jobs))

    runner = threading.Thread(target=load)
    runner.start()
    for role, count in (("draft", "2"), ("target", "2"), ("target", "1"), ("draft", "1")):
        _tandem(pools, "pools", "scale", "--name", "t", role, count)
    time.sleep(3)  # gateways follow the membership every 2 s
    scaled.set()
    runner.join(timeout=300)
    assert all(len(out) == 8 for out in rounds), [len(out) for out in rounds]
    assert all(ids == expected[i] for out in rounds for (_, i), ids in out.items())
    names = sorted(w["name"] for w in _status(pools)["workers"])
    assert names == ["draft-0", "target-0"]


def test_a_sessions_next_turn_through_another_gateway_reuses_the_pools_cache(pools, gateways) -> None:
    def turn(gateway: Gateway, prompt: list[int]) -> list[int]:
        with TandemClient(gateway.address, timeout=120) as client:
            return [t for item in client.generate(token_ids=prompt, temperature=0.0, max_tokens=8, ignore_eos=True,
                                                  session_id="chat-1") for t in getattr(item, "token_ids", [])]

    def reused() -> int:
        return sum(w["reused_tokens"] for w in _status(pools)["workers"] if w["role"] == "target")

    first = PROMPTS[2] * 4
    answer = turn(gateways[0], first)
    before = reused()
    turn(gateways[1], first + answer + [9, 10, 11])
    assert reused() - before >= len(first), "the second turn should start from the first turn's cached tokens"


def test_a_gateway_killed_leaves_the_workers_and_the_other_gateway_serving(pools, gateways, expected) -> None:
    pids = {w["name"]: w["pid"] for w in _status(pools)["workers"]}
    out: dict = {}
    jobs = [(gateways[1].address, i) for i in range(4)]
    runner = threading.Thread(target=lambda: out.update(_at_once(jobs, pair_ids=False)))
    runner.start()
    time.sleep(0.5)
    gateways[0].stop(signal.SIGKILL)
    runner.join(timeout=300)
    assert [out[(i, i)] for i in range(4)] == expected
    status = _status(pools)
    assert all(w["healthy"] for w in status["workers"])
    assert {w["name"]: w["pid"] for w in status["workers"]} == pids, "a gateway's exit must not restart workers"


def test_a_gateway_with_two_engine_lanes_stays_exact_on_the_shared_pools(pools, expected) -> None:
    with EmbeddedRedis() as redis:
        gateway = Gateway(pools, redis.url, "--lanes", "2")
        try:
            out = _at_once([(gateway.address, i) for i in range(len(PROMPTS))] * 2, pair_ids=False)
        finally:
            gateway.stop()
    assert len(out) == 2 * len(PROMPTS)
    assert all(ids == expected[i] for (_, i), ids in out.items())


def test_a_gateway_refuses_pools_of_another_image() -> None:
    from tandem.errors import TandemError
    from tandem.pools.attach import check_image

    check_image("t", "", "repo/tandem:2")  # pools started without an image: nothing to compare
    check_image("t", "repo/tandem:2", "repo/tandem:2")
    with pytest.raises(TandemError, match=r"repo/tandem:2 but pools 't' run repo/tandem:1"):
        check_image("t", "repo/tandem:1", "repo/tandem:2")


def _kill_for_good(address: str, actor: str) -> None:
    script = (f"import ray; ray.init(log_to_driver=False); "
              f"ray.kill(ray.get_actor({actor!r}, namespace='tandem'), no_restart=True)")
    done = subprocess.run([sys.executable, "-c", script], env=_env(address), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def _wait_health(address: str, want: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with TandemClient(address, timeout=10) as client:
        while client.health_status(READINESS) != want:
            assert time.monotonic() < deadline, f"readiness never turned {want}"
            time.sleep(0.2)


def test_a_restarted_manager_adopts_its_workers_and_gateways_keep_serving(pools, gateways, expected) -> None:
    before = _status(pools)
    os.kill(before["manager_pid"], signal.SIGKILL)  # Ray restarts it (its node, or the head, went away)
    deadline = time.monotonic() + 120
    while True:
        try:
            after = _status(pools)
            if after["manager_pid"] != before["manager_pid"]:
                break
        except AssertionError:
            pass  # still restarting
        assert time.monotonic() < deadline, "the manager did not come back"
        time.sleep(0.5)
    assert [(w["name"], w["pid"]) for w in after["workers"]] == [(w["name"], w["pid"]) for w in before["workers"]]
    _tandem(pools, "pools", "scale", "--name", "t", "draft", "2")  # it still manages them: scaling goes on
    time.sleep(3)
    gateway = next(g for g in gateways if g.process.poll() is None)
    out = _at_once([(gateway.address, i) for i in range(len(PROMPTS))], pair_ids=False)
    assert [out[(i, i)] for i in range(len(PROMPTS))] == expected
    _tandem(pools, "pools", "scale", "--name", "t", "draft", "1")


def test_pool_commands_need_a_cluster_and_refuse_duplicates(pools, tiny_dirs) -> None:
    done = subprocess.run([str(BIN / "tandem"), "pools", "status"], capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in _env(pools).items() if k != "RAY_ADDRESS"})
    assert done.returncode == 2 and "--ray-address" in done.stderr
    done = subprocess.run([str(BIN / "tandem"), "pools", "start", "--name", "t", "--target", str(tiny_dirs.target),
                           "--no-spec"], env=_env(pools), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "already running" in done.stderr
    done = subprocess.run([str(BIN / "tandem"), "gateway", "--pools", "nope", "--port", "0"], env=_env(pools),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "no pools named 'nope'" in done.stderr + done.stdout


def test_a_dead_target_replica_moves_its_sessions_and_none_left_is_unavailable_until_one_is_back(pools, gateways,
                                                                                                  expected) -> None:
    """Last in this module: it kills the pools' target replicas for good."""
    gateway = next(g for g in gateways if g.process.poll() is None)
    _tandem(pools, "pools", "scale", "--name", "t", "target", "2")
    time.sleep(3)  # gateways follow the membership every 2 s
    first, second = (w["name"] for w in _status(pools)["workers"] if w["role"] == "target")
    out: dict = {}
    jobs = [(gateway.address, i) for i in range(len(PROMPTS))] * 2
    runner = threading.Thread(target=lambda: out.update(_at_once(jobs, pair_ids=False)))
    runner.start()
    time.sleep(0.3)
    _kill_for_good(pools, f"tandem-pools-t-{first}")
    runner.join(timeout=300)
    assert len(out) == len(jobs), "a replica's death must not fail its sessions while another replica is left"
    assert all(ids == expected[i] for (_, i), ids in out.items())
    deadline = time.monotonic() + 30  # the manager drops a worker that died for good within seconds
    while [w["name"] for w in _status(pools)["workers"] if w["role"] == "target"] != [second]:
        assert time.monotonic() < deadline, _status(pools)
        time.sleep(0.5)

    _kill_for_good(pools, f"tandem-pools-t-{second}")
    with TandemClient(gateway.address, timeout=60) as client, pytest.raises(grpc.RpcError) as failed:
        list(client.generate(token_ids=PROMPTS[0], temperature=0.0, max_tokens=TOKENS, ignore_eos=True))
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
    _wait_health(gateway.address, NOT_SERVING, 30)
    _tandem(pools, "pools", "scale", "--name", "t", "target", "1")  # a new replica: target-2
    _wait_health(gateway.address, SERVING, 120)
    out = _at_once([(gateway.address, 0)])
    assert out[(0, 0)] == expected[0]
