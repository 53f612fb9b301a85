"""`tandem serve` without --ray-address starts a Ray of its own, whatever else runs on the machine: ray.init without
an address joins the cluster `ray start` leaves on it (and then refuses num_cpus: `tandem serve` failed with a
traceback beside another Ray). Checked in a process of its own, where ray.init only records what it was asked."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("ray")

SCRIPT = """if True:
    import json, ray
    from tandem.engines import ClusterOptions
    from tandem.engines.cluster import start_ray

    asked = {}
    ray.init = lambda **kwargs: asked.update(kwargs)
    start_ray(ClusterOptions(draft_workers=1, target_replicas=1))
    print(json.dumps({k: v for k, v in asked.items() if k in ("address", "_node_ip_address", "num_cpus")}))
"""


def test_serve_starts_a_ray_of_its_own_on_loopback_even_beside_another() -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"}  # no RAY_ADDRESS, no token settings of the test's Ray
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    asked = json.loads(done.stdout.splitlines()[-1])
    assert asked["address"] == "local" and asked["_node_ip_address"] == "127.0.0.1" and asked["num_cpus"] >= 3
