"""What the shared-pools tests share: a Ray head of their own on loopback, the `tandem` command against it, gateway
processes, and concurrent greedy requests."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from tandem.bench.local_cluster import start_ray_head, wait_serving
from tandem.client import TandemClient
from tandem.core.config import SamplingParams
from tandem.engines.local import build_engine

TOKENS = 40
PROMPTS = [[5, 6, 7, 8], [40, 50, 60], [1, 2, 3, 4, 5, 6, 7], [200, 17, 33]]
BIN = Path(sys.executable).parent
SERVING, NOT_SERVING = 1, 2  # grpc.health.v1
READINESS = "tandem.v1.GenerationService"


def plain_greedy(tiny_models, tokens: int = TOKENS) -> list[list[int]]:
    """PROMPTS decoded greedily by the tiny target alone, in process: what every pool stream must equal."""
    greedy = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return [r.token_ids for r in build_engine(tiny_models[0], None).generate(PROMPTS, greedy)]


def pool_status(address: str, name: str = "t") -> dict:
    """`tandem pools status --json` of pool `name` on the cluster at `address`."""
    return json.loads(tandem_cli(address, "pools", "status", "--name", name, "--json"))


def assert_workers_kept(address: str, pids: dict[str, int], name: str = "t") -> None:
    """Every worker of pool `name` healthy and the same process as in `pids` (name -> pid): not restarted."""
    status = pool_status(address, name)
    assert all(w["healthy"] for w in status["workers"])
    assert {w["name"]: w["pid"] for w in status["workers"]} == pids, "a gateway's exit must not restart workers"


def wait_sequences_released(address: str, timeout_s: float, name: str = "t") -> None:
    """Until no worker of pool `name` holds a sequence; AssertionError (with the workers) past `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while any(w["sequences"] for w in pool_status(address, name)["workers"]):
        assert time.monotonic() < deadline, pool_status(address, name)["workers"]
        time.sleep(1.0)


@pytest.fixture(scope="module", name="expected")
def expected_fixture(tiny_models) -> list[list[int]]:
    """plain_greedy's tokens, once a module (a module imports this by name: `expected_fixture,  # noqa: F401`)."""
    return plain_greedy(tiny_models)


def _token_file() -> str:
    """The token of the test heads (Ray token authentication, as tandem's own clusters run): a 0600 file of its own,
    removed at exit."""
    directory = tempfile.mkdtemp(prefix="tandem-test-ray-auth-")
    path = os.path.join(directory, "auth_token")
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as handle:
        handle.write(secrets.token_hex(32))
    atexit.register(shutil.rmtree, directory, True)
    return path


RAY_TOKEN_FILE = _token_file()


def head_env(address: str, token: bool = True) -> dict:
    """The environment of the test head and of every process that joins it: token auth, the head's token (the
    `tandem` commands pick it up from $RAY_AUTH_TOKEN_PATH, as a Kubernetes Secret would pass it). Not this
    process's own Ray settings: its local Ray has a token of its own."""
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": RAY_TOKEN_FILE} if token else {}
    return inherited | auth | {"RAY_ADDRESS": address, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                               "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}


def tandem_cli(address: str, *args: str, timeout: float = 180) -> str:
    done = subprocess.run([str(BIN / "tandem"), *args], env=head_env(address), capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@contextlib.contextmanager
def ray_head(temp: Path, cpus: int = 8, client_port: int | None = None) -> Iterator[str]:
    """A Ray head on loopback, apart from the test process's own Ray; yields its address. Started with --block so
    that stopping it stops this head alone (`ray stop` would stop every Ray on the machine). `client_port`: its Ray
    Client server's port (ray_client_address), listening once this yields."""
    if shutil.which("ray", path=str(BIN)) is None:
        pytest.skip("no ray command")
    head, address = start_ray_head(str(temp), head_env, cpus, client_port=client_port)
    try:
        if client_port is not None:
            wait_listening(client_port, head)
        yield address
    finally:
        head.terminate()
        head.wait(timeout=120)


def ray_client_address(client_port: int) -> str:
    """The Ray Client URL of a test head started with `client_port` (ray_head)."""
    return f"ray://127.0.0.1:{client_port}"


def wait_listening(port: int, head: subprocess.Popen, timeout_s: float = 60) -> None:
    """Until something accepts connections on the loopback `port` (a head's Ray Client server, which `ray start`
    launches as a process of its own); RuntimeError when the head exits or `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if head.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nothing listens on 127.0.0.1:{port}") from None
            time.sleep(0.2)


class Gateway:
    """`tandem gateway --pools POOL` in a process of its own, ready once constructed. `program`: the command that
    runs `tandem` (a Python wrapper, say), `env`: variables to add, `log`: a file for its stderr (else dropped)."""

    def __init__(self, address: str, redis_url: str, *flags: str, pool: str = "t",
                 program: tuple[str, ...] = (str(BIN / "tandem"),), env: dict | None = None,
                 log: Path | None = None) -> None:
        with open(log or os.devnull, "w") as stderr:  # the child holds its own copy of the descriptor
            self.process = subprocess.Popen([*program, "gateway", "--pools", pool, "--port", "0",
                                             "--metrics-port", "-1", "--redis-url", redis_url, *flags],
                                            env=head_env(address) | (env or {}), stdout=subprocess.PIPE,
                                            stderr=stderr, text=True)
        self.address = wait_serving(self.process, timeout_s=180)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.process.send_signal(sig)
        self.process.wait(timeout=60)


def start_gateways(address: str, redis_url: str, count: int, pool: str = "t") -> list[Gateway]:
    """`count` gateways started side by side (each spends seconds importing the engine and joining Ray). When one
    fails to start, those that did are stopped before the error is raised."""
    with ThreadPoolExecutor(count) as executor:
        futures = [executor.submit(Gateway, address, redis_url, pool=pool) for _ in range(count)]
    started = [f.result() for f in futures if f.exception() is None]
    if len(started) < count:
        for gateway in started:
            gateway.stop()
        next(f for f in futures if f.exception() is not None).result()
    return started


def generate_greedy(address: str, prompt: list[int], out: dict, key, request_id: str, tokens: int = TOKENS) -> None:
    """`out[key]`: the streamed ids, or the grpc.RpcError the stream ended with."""
    with TandemClient(address, timeout=120) as client:
        ids = []
        try:
            for item in client.generate(token_ids=prompt, temperature=0.0, max_tokens=tokens, ignore_eos=True,
                                        request_id=request_id):
                ids += list(getattr(item, "token_ids", []))
        except grpc.RpcError as exc:
            out[key] = exc
            return
        out[key] = ids


def at_once(jobs: list[tuple[str, int]], tokens: int = TOKENS, ids: str = "r") -> dict:
    """Every job (gateway address, prompt index) as a greedy stream at once, job n as request id `{ids}{n}` (unique
    across the gateways: gateways sharing a Redis refuse an id another one runs; calls at once take other `ids`);
    `out[(n, prompt index)]`."""
    out: dict = {}
    threads = [threading.Thread(target=generate_greedy, args=(address, PROMPTS[i], out, (n, i),
                                                        f"{ids}{n}", tokens))
               for n, (address, i) in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    return out


def kill_for_good(address: str, actor: str) -> None:
    script = (f"import ray; ray.init(log_to_driver=False); "
              f"ray.kill(ray.get_actor({actor!r}, namespace='tandem'), no_restart=True)")
    done = subprocess.run([sys.executable, "-c", script], env=head_env(address), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def wait_health(address: str, want: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with TandemClient(address, timeout=10) as client:
        while client.health_status(READINESS) != want:
            assert time.monotonic() < deadline, f"readiness never turned {want}"
            time.sleep(0.2)


def named_actors(address: str) -> tuple[list[str], float]:
    """The named actors on the cluster at `address`, sorted, and the CPUs its actors hold."""
    script = ("import ray, json; ray.init(log_to_driver=False, namespace='tandem'); "
              "names = sorted(a['name'] for a in ray.util.list_named_actors(all_namespaces=True)); "
              "used = ray.cluster_resources()['CPU'] - ray.available_resources().get('CPU', 0); "
              "print(json.dumps([names, used]))")
    done = subprocess.run([sys.executable, "-c", script], env=head_env(address), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    names, used = json.loads(done.stdout.strip().splitlines()[-1])
    return names, used
