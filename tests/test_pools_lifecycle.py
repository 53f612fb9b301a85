"""Shared pools' lifecycle as operators meet it, on a Ray head of its own with tiny pools (target only): pools that go
away under a busy gateway or come back with other models, starts that race or are stopped, a corrupt model file.

A stream running when `tandem pools stop` removes every replica fails UNAVAILABLE within seconds: the gateway no
longer waits out Ray's restart of workers that the pools' manager no longer lists (it waited 30 s, its readiness
SERVING and new requests taken meanwhile). Pools started again with other models end the gateway with status 3, so
that a supervisor restarting failed processes starts the fresh gateway they need."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time

import grpc
import pytest

pytest.importorskip("ray")

from pools_harness import BIN, NOT_SERVING, PROMPTS, SERVING, Gateway, head_env, ray_head, tandem_cli, wait_health
from tandem.client import TandemClient
from tandem.engines.shared_pools import EXIT_MODELS_CHANGED
from tandem.sessions import EmbeddedRedis

POOL = ("--threads", "1", "--dtype", "float32", "--no-spec")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with ray_head(tmp_path_factory.mktemp("ray")) as address:
        yield address


def test_pools_stopped_under_a_stream_fail_it_at_once_and_other_models_end_the_gateway(cluster, tiny_dirs) -> None:
    tandem_cli(cluster, "pools", "start", "--name", "t", "--target", str(tiny_dirs.target), *POOL)
    with EmbeddedRedis() as redis:
        gateway = Gateway(cluster, redis.url)
        try:
            ended: dict = {}

            def stream() -> None:
                with TandemClient(gateway.address, timeout=300) as client:
                    try:
                        for _ in client.generate(token_ids=PROMPTS[0], temperature=0.0, max_tokens=4000,
                                                 ignore_eos=True):
                            ended.setdefault("first", time.monotonic())
                    except grpc.RpcError as exc:
                        ended["error"] = exc
                    ended["at"] = time.monotonic()

            runner = threading.Thread(target=stream)
            runner.start()
            deadline = time.monotonic() + 60
            while "first" not in ended:
                assert time.monotonic() < deadline and runner.is_alive(), ended
                time.sleep(0.05)
            tandem_cli(cluster, "pools", "stop", "--name", "t")
            stopped = time.monotonic()
            runner.join(timeout=120)
            assert ended["error"].code() == grpc.StatusCode.UNAVAILABLE, ended["error"].details()
            assert ended["at"] - stopped < 15, "the stream waited for replicas the stopped pools will not restart"
            wait_health(gateway.address, NOT_SERVING, 10)
            with TandemClient(gateway.address, timeout=30) as client, pytest.raises(grpc.RpcError) as refused:
                client.generate_text(token_ids=PROMPTS[1], max_tokens=4)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

            tandem_cli(cluster, "pools", "start", "--name", "t", "--target", str(tiny_dirs.draft), *POOL)
            assert gateway.process.wait(timeout=120) == EXIT_MODELS_CHANGED
        finally:
            if gateway.process.poll() is None:
                gateway.stop()
            tandem_cli(cluster, "pools", "stop", "--name", "t")


def test_readiness_is_serving_again_once_pools_with_the_same_models_are_back(cluster, tiny_dirs) -> None:
    tandem_cli(cluster, "pools", "start", "--name", "u", "--target", str(tiny_dirs.target), *POOL)
    with EmbeddedRedis() as redis:
        gateway = Gateway(cluster, redis.url, pool="u")
        try:
            tandem_cli(cluster, "pools", "stop", "--name", "u")
            wait_health(gateway.address, NOT_SERVING, 30)
            tandem_cli(cluster, "pools", "start", "--name", "u", "--target", str(tiny_dirs.target), *POOL)
            wait_health(gateway.address, SERVING, 120)
            with TandemClient(gateway.address, timeout=60) as client:
                assert client.generate_text(token_ids=PROMPTS[1], max_tokens=4, temperature=0.0)
        finally:
            gateway.stop()
            tandem_cli(cluster, "pools", "stop", "--name", "u")


def tandem_run(cluster: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "tandem"), *args], env=head_env(cluster), capture_output=True, text=True,
                          timeout=180)


def test_two_starts_of_one_name_at_once_and_a_stop_during_a_start_end_in_one_line(cluster, tiny_dirs) -> None:
    start = [str(BIN / "tandem"), "pools", "start", "--name", "v", "--target", str(tiny_dirs.target), *POOL]
    racing = [subprocess.Popen(start, env=head_env(cluster), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                               text=True) for _ in range(2)]
    outcomes = sorted((process.wait(timeout=180), process.stderr.read()) for process in racing)
    assert [code for code, _ in outcomes] == [0, 2], outcomes
    assert "pools named 'v' are already running" in outcomes[1][1] and "Traceback" not in outcomes[1][1]
    tandem_cli(cluster, "pools", "stop", "--name", "v")

    starting = subprocess.Popen([*start[:4], "w", *start[5:]], env=head_env(cluster), stderr=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 60
    while tandem_run(cluster, "pools", "status", "--name", "w").returncode:
        assert time.monotonic() < deadline and starting.poll() is None, "the pools' manager never appeared"
        time.sleep(0.2)
    tandem_cli(cluster, "pools", "stop", "--name", "w")
    code, error = starting.wait(timeout=120), starting.stderr.read()
    if code:  # (a start that had finished before the stop came exits 0)
        assert code == 2 and "Traceback" not in error and error.strip().splitlines()[-1].startswith("error: "), error


def test_a_corrupt_weights_file_names_the_worker_and_the_model_and_an_empty_pools_name_is_refused(
        cluster, tiny_dirs, tmp_path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dirs.target, broken)
    with open(broken / "model.safetensors", "r+b") as weights:
        weights.truncate(1000)
    done = tandem_run(cluster, "pools", "start", "--name", "brk", "--target", str(broken), *POOL)
    error = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and error.startswith("error: a target worker on "), done.stderr[-2000:]
    assert f"model {broken}: " in error and "Traceback" not in done.stderr
    done = tandem_run(cluster, "gateway", "--pools", "", "--port", "0")
    assert done.returncode == 2 and "pools: letters, digits and dashes only, got ''" in done.stderr
