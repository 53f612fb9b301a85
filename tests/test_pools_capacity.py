"""Shared pools asked for more than the cluster has room for: `tandem pools start` and `scale` report the workers Ray
cannot place, give up past --timeout, and a later scale corrects the count at once (a Ray head of 2 CPUs)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
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
        waiting = subprocess.Popen([str(BIN / "tandem"), "pools", "scale", "--name", "s", "target", "3", "--timeout",
                                    "60"], env=head_env(small_cluster), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        time.sleep(3)
        scaled = json.loads(tandem_cli(small_cluster, "pools", "scale", "--name", "s", "target", "1", timeout=60))
        assert scaled["workers"]["target"] == ["target-0"] and scaled["starting"]["target"] == [], scaled
        # The scale to 3 still waiting was overtaken: its caller must not read success.
        _, err = waiting.communicate(timeout=60)
        assert waiting.returncode == 2 and "Traceback" not in err, err[-2000:]
        assert err.splitlines()[-1] == "error: pools s: target has 1 workers, not the 3 asked for: a later scale " \
            "(or a worker's death) changed the count while this one waited; `tandem pools status --name s`", err
        _actors_settle(small_cluster, ["tandem-pools-s", "tandem-pools-s-target-0"], 1.0)

        # With room again, a scale waits for its worker, reporting its progress, and returns once it serves.
        done = _run(small_cluster, "pools", "scale", "--name", "s", "target", "2")
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads(done.stdout)["workers"]["target"] == ["target-0", "target-3"]
        assert "pools s: target-3 ready after" in done.stderr
    finally:
        tandem_cli(small_cluster, "pools", "stop", "--name", "s")
    _actors_settle(small_cluster, [], 0.0)


def _in_cluster(address: str, script: str) -> str:
    """`script` run by a Ray client of the cluster, in the pools' namespace (`ray` imported, `m` the manager of `s`)."""
    code = ("import ray; ray.init(log_to_driver=False, namespace='tandem'); "
            "m = ray.get_actor('tandem-pools-s', namespace='tandem'); " + script)
    done = subprocess.run([sys.executable, "-c", code], env=head_env(address), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_a_restarted_manager_waits_again_for_a_worker_still_starting(small_cluster, tiny_dirs) -> None:
    """A worker the manager that died was still waiting for is starting to the new one (it listed it as serving:
    gateways routed to a worker with no process yet), and a scale waiting on it rides the restart out."""
    tandem_cli(small_cluster, "pools", "start", "--name", "s", "--target", str(tiny_dirs.target), "--no-spec",
               "--threads", "1", "--dtype", "float32", "--target-replicas", "2")
    try:
        waiting = subprocess.Popen([str(BIN / "tandem"), "pools", "scale", "--name", "s", "target", "3", "--timeout",
                                    "25"], env=head_env(small_cluster), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        time.sleep(8)
        _in_cluster(small_cluster, "ray.kill(m, no_restart=False)")  # Ray restarts it; it adopts its workers
        _, err = waiting.communicate(timeout=120)
        assert waiting.returncode == 2 and "Traceback" not in err, err[-2000:]
        assert "still starting after 25 s: target-2 pending" in err.splitlines()[-1], err[-2000:]
        status = json.loads(tandem_cli(small_cluster, "pools", "status", "--name", "s", "--json", timeout=60))
        states = {w["name"]: w["state"] for w in status["workers"]}
        assert states == {"target-0": "ready", "target-1": "ready", "target-2": "pending"}, status
        routed = _in_cluster(small_cluster, "print(ray.get(m.describe.remote())['workers']['target'])")
        assert routed.strip().splitlines()[-1] == "['target-0', 'target-1']", routed  # what gateways route to
        # A scale once the pools are stopping would start workers no pool owns.
        refused = _in_cluster(small_cluster, "ray.get(m.stop.remote())\n"
                                             "try:\n    ray.get(m.scale.remote('target', 3))\n"
                                             "except ray.exceptions.RayTaskError as exc:\n    print(exc.cause)")
        assert "pools: 's' are stopping" in refused, refused
    finally:
        tandem_cli(small_cluster, "pools", "stop", "--name", "s")
    _actors_settle(small_cluster, [], 0.0)


def test_a_worker_that_fails_to_load_says_why_in_one_line_and_in_the_status(small_cluster, tiny_dirs,
                                                                             tmp_path) -> None:
    target = tmp_path / "target"
    shutil.copytree(tiny_dirs.target, target)
    tandem_cli(small_cluster, "pools", "start", "--name", "s", "--target", str(target), "--no-spec", "--threads", "1",
               "--dtype", "float32")
    try:
        (target / "model.safetensors").write_bytes(b"\0" * 16)  # the next worker's load fails (no manifest here)
        done = _run(small_cluster, "pools", "scale", "--name", "s", "target", "2", "--timeout", "120")
        assert done.returncode == 2, done.stderr[-2000:]
        error = done.stderr.strip().splitlines()[-1]
        assert error.startswith("error: ") and "Error: " in error and "\x1b[" not in error, done.stderr[-2000:]
        assert "Traceback" not in done.stderr and "ray::" not in error
        status = tandem_cli(small_cluster, "pools", "status", "--name", "s")
        assert "target target-1   FAILED to start" in status and error[len("error: "):] in status, status
    finally:
        tandem_cli(small_cluster, "pools", "stop", "--name", "s")
    _actors_settle(small_cluster, [], 0.0)


def test_a_start_stops_workers_a_lost_manager_of_its_name_left(small_cluster, tiny_dirs) -> None:
    """Detached workers outlive a manager killed for good; their names refused the next start's (a traceback)."""
    orphan = ("@ray.remote(num_cpus=0)\nclass W:\n    pass\n"
              "w = W.options(name='tandem-pools-s-target-0', namespace='tandem', lifetime='detached').remote()\n"
              "ray.get(w.__ray_ready__.remote())")
    done = subprocess.run([sys.executable, "-c", "import ray; ray.init(log_to_driver=False)\n" + orphan],
                          env=head_env(small_cluster), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    try:
        done = _run(small_cluster, "pools", "start", "--name", "s", "--target", str(tiny_dirs.target), "--no-spec",
                    "--threads", "1", "--dtype", "float32")
        assert done.returncode == 0, done.stderr[-2000:]
        assert "pools s: stopped 1 workers that pools of this name left behind when their manager was lost: " \
               "target-0" in done.stderr
        assert json.loads(done.stdout)["workers"]["target"] == ["target-0"]
    finally:
        tandem_cli(small_cluster, "pools", "stop", "--name", "s")
    _actors_settle(small_cluster, [], 0.0)
