"""Gateways on shared pools time the pools' forwards once: the first gateway calibrates (adaptive k), the pool manager
keeps its costs, and later gateways with the same --max-batch adopt them instead of running calibration forwards on
workers that serve traffic. A restarted manager (it keeps them in memory) has them back from the gateways
attached to it within their next membership poll."""

from __future__ import annotations

import os
import signal
import time

import pytest

pytest.importorskip("ray")

from pools_harness import (
    PROMPTS,
    Gateway,
    at_once,
    plain_greedy,
    pool_status,
    ray_head,
    tandem_cli,
)
from tandem.sessions import EmbeddedRedis


@pytest.fixture(scope="module")
def adaptive_pools(tmp_path_factory, tiny_dirs):
    with ray_head(tmp_path_factory.mktemp("ray")) as address:
        tandem_cli(address, "pools", "start", "--name", "c", "--target", str(tiny_dirs.target), "--draft",
                   str(tiny_dirs.draft), "--threads", "1", "--dtype", "float32")  # adaptive k: gateways calibrate
        yield address
        tandem_cli(address, "pools", "stop", "--name", "c")


def _forwards(status: dict) -> int:
    return sum(w["forwards"] for w in status["workers"])


def test_the_first_gateway_calibrates_and_the_next_adopts_its_costs(adaptive_pools, tiny_models) -> None:
    expected = plain_greedy(tiny_models)
    with EmbeddedRedis() as redis:
        started = [Gateway(adaptive_pools, redis.url, pool="c")]
        try:
            status = pool_status(adaptive_pools, "c")
            assert status["calibrated_batches"] == [16]
            calibrated = _forwards(status)
            assert calibrated > 20, "the first gateway should have timed forwards on the workers"

            started.append(Gateway(adaptive_pools, redis.url, pool="c"))
            assert _forwards(pool_status(adaptive_pools, "c")) == calibrated, "the second gateway ran forwards to start"
            out = at_once([(started[1].address, i) for i in range(len(PROMPTS))])
            assert [out[(i, i)] for i in range(len(PROMPTS))] == expected

            before = _forwards(pool_status(adaptive_pools, "c"))
            started.append(Gateway(adaptive_pools, redis.url, "--max-batch", "4", pool="c"))
            status = pool_status(adaptive_pools, "c")
            assert status["calibrated_batches"] == [4, 16] and _forwards(status) > before

            os.kill(status["manager_pid"], signal.SIGKILL)  # Ray restarts it: it adopts the workers, not the costs
            _restarted_and_reseeded(adaptive_pools, status["manager_pid"], [4, 16])
            calibrated = _forwards(pool_status(adaptive_pools, "c"))
            started.append(Gateway(adaptive_pools, redis.url, pool="c"))
            assert _forwards(pool_status(adaptive_pools, "c")) == calibrated, "a gateway calibrated after the restart"
        finally:
            for gateway in started:
                gateway.stop()


def _restarted_and_reseeded(address: str, killed_pid: int, batches: list[int]) -> None:
    """Wait until a new manager answers and the gateways' costs are back in it (they poll every 2 s)."""
    deadline = time.monotonic() + 120
    while True:
        try:
            status = pool_status(address, "c")
            if status["manager_pid"] != killed_pid and status["calibrated_batches"] == batches:
                return
        except AssertionError:
            status = {}  # still restarting
        assert time.monotonic() < deadline, f"the costs did not come back: {status.get('calibrated_batches')}"
        time.sleep(0.5)
