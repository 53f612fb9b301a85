"""Shared pools asked for more than the cluster has room for: `tandem pools start` and `scale` report the workers Ray
cannot place, give up past --timeout, and a later scale corrects the count at once (a Ray head of 2 CPUs)."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

pytest.importorskip("ray")

from pools_harness import BIN, head_env, named_actors, ray_head, tandem_cli


@pytest.fixture(scope="module")
def small_cluster(tmp_path_factory):
    with ray_head(tmp_path_factory.mktemp("ray"), cpus=2) as address:
        yield address


def _run(address: str, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "tandem"), *args], env=head_env(address), capture_output=True, text=True,
                          timeout=timeout)


def _actors_settle(address: str, expected: list[str], cpus: float, timeout_s: float = 60) -> None:
    """Killed actors give their CPUs back within moments, not at once."""
    deadline = time.monotonic() + timeout_s
    while (found := named_actors(address)) != (expected, cpus):
        assert time.monotonic() < deadline, found
        time.sleep(1)


def test_a_start_the_cluster_has_no_room_for_fails_past_its_timeout_and_leaves_nothing(small_cluster,
                                                                                      tiny_dirs) -> None:
    done = _run(small_cluster, "pools", "start", "--name", "g", "--target", str(tiny_dirs.target), "--no-spec",
                "--threads", "1", "--dtype", "float32", "--target-gpus", "1", "--timeout", "8")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "pools g: target-0 pending" in done.stderr and "it asks for CPU 1, GPU 1" in done.stderr
    assert "the cluster has CPU 2, GPU 0 free" in done.stderr
    assert "error: pools g: still starting after 8 s: target-0 pending" in done.stderr
    assert "Traceback" not in done.stderr
    _actors_settle(small_cluster, [], 0.0)
    assert tandem_cli(small_cluster, "pools", "status").startswith("no pools on this Ray cluster")


def test_a_scale_past_the_clusters_room_gives_up_and_a_corrective_scale_stops_what_still_starts(small_cluster,
                                                                                              tiny_dirs) -> None:
    tandem_cli(small_cluster, "pools", "start", "--name", "s", "--target", str(tiny_dirs.target), "--no-spec",
               "--threads", "1", "--dtype", "float32")
    try:
        # Two CPUs: target-1 finds room and loads, target-2 waits for a node with a free CPU (reported once that
        # lasts 5 s: Ray places a worker a moment after it is asked for).
        done = _run(small_cluster, "pools", "scale", "--name", "s", "target", "3", "--timeout", "15")
        assert done.returncode == 2, done.stderr[-2000:]
        assert "pools s: target-2 pending: Ray has placed it on no node yet; it asks for CPU 1" in done.stderr
        assert "still starting after 15 s" in done.stderr and "target-2 pending" in done.stderr.splitlines()[-1]
        assert "`tandem pools scale --name s target N` with a smaller N stops them" in done.stderr

        # The manager answers while target-2 waits: status lists it as starting, and a scale down is not held up.
        status = json.loads(tandem_cli(small_cluster, "pools", "status", "--name", "s", "--json", timeout=60))
        assert {"role": "target", "name": "target-2", "healthy": False, "state": "pending"} in status["workers"]
        scaled = json.loads(tandem_cli(small_cluster, "pools", "scale", "--name", "s", "target", "1", timeout=60))
        assert scaled["workers"]["target"] == ["target-0"] and scaled["starting"]["target"] == [], scaled
        _actors_settle(small_cluster, ["tandem-pools-s", "tandem-pools-s-target-0"], 1.0)

        # With room again, a scale waits for its worker, reporting its progress, and returns once it serves.
        done = _run(small_cluster, "pools", "scale", "--name", "s", "target", "2")
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads(done.stdout)["workers"]["target"] == ["target-0", "target-3"]
        assert "pools s: target-3 ready after" in done.stderr
    finally:
        tandem_cli(small_cluster, "pools", "stop", "--name", "s")
    _actors_settle(small_cluster, [], 0.0)
