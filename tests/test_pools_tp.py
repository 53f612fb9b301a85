"""Shared pools of tensor-parallel target replicas: two gateways on one replica of two gloo ranks (rank 0 leads, the
other runs its calls in rank 0's order), and a group with a dead rank replaced by the pool manager."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("ray")

from pools_harness import (
    PROMPTS,
    SERVING,
    at_once,
    expected_fixture,  # noqa: F401 (the expected fixture)
    kill_for_good,
    named_actors,
    ray_head,
    start_gateways,
    tandem_cli,
    wait_health,
)
from tandem.sessions import EmbeddedRedis


@pytest.fixture(scope="module")
def tp_pools(tmp_path_factory, tiny_dirs):
    with ray_head(tmp_path_factory.mktemp("ray")) as address:
        tandem_cli(address, "pools", "start", "--name", "tp", "--tp", "2", "--target", str(tiny_dirs.target),
                   "--draft", str(tiny_dirs.draft), "--threads", "1", "--dtype", "float32", "--fixed-k", "4",
                   "--batch-window-ms", "50")
        yield address
        tandem_cli(address, "pools", "stop", "--name", "tp")


def _targets(address: str) -> list[dict]:
    status = json.loads(tandem_cli(address, "pools", "status", "--name", "tp", "--json"))
    return [w for w in status["workers"] if w["role"] == "target"]


def _answering_targets(address: str, timeout_s: float = 60) -> list[dict]:
    """_targets once each answered the status call in time (on a loaded host one may miss its 2 s and show no
    counters)."""
    deadline = time.monotonic() + timeout_s
    targets = _targets(address)
    while not all(w["healthy"] for w in targets):
        assert time.monotonic() < deadline, targets
        time.sleep(1)
        targets = _targets(address)
    return targets


def test_two_gateways_share_a_tensor_parallel_replica_and_a_broken_group_is_replaced(tp_pools, expected) -> None:
    names, _ = named_actors(tp_pools)
    assert names == ["tandem-pools-tp", "tandem-pools-tp-draft-0", "tandem-pools-tp-target-0",
                     "tandem-pools-tp-target-0-rank1"]
    with EmbeddedRedis() as redis:
        gateways = start_gateways(tp_pools, redis.url, 2, pool="tp")
        try:
            out = at_once([(gateways[0].address, 0), (gateways[1].address, 1)] * 2)
            assert out == {(n, i): expected[i] for n, i in [(0, 0), (1, 1), (2, 0), (3, 1)]}
            status = json.loads(tandem_cli(tp_pools, "pools", "status", "--name", "tp", "--json"))
            assert status["tensor_parallel"] == 2
            [target] = _answering_targets(tp_pools)
            assert target["merged_forwards"] > 0, "no verify forward served both gateways"

            kill_for_good(tp_pools, "tandem-pools-tp-target-0-rank1")  # the group cannot run without it
            deadline = time.monotonic() + 180
            while [(w["name"], w["healthy"]) for w in _targets(tp_pools)] != [("target-1", True)]:
                assert time.monotonic() < deadline, _targets(tp_pools)
                time.sleep(1)
            names, _ = named_actors(tp_pools)
            assert names == ["tandem-pools-tp", "tandem-pools-tp-draft-0", "tandem-pools-tp-target-1",
                             "tandem-pools-tp-target-1-rank1"]
            time.sleep(3)  # gateways follow the membership every 2 s
            for gateway in gateways:
                wait_health(gateway.address, SERVING, 60)
            out = at_once([(gateways[n % 2].address, i) for n, i in enumerate(range(len(PROMPTS)))])
            assert [out[(i, i)] for i in range(len(PROMPTS))] == expected
        finally:
            for gateway in gateways:
                gateway.stop()
