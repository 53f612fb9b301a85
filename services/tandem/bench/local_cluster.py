"""Processes the pool benchmarks run on this machine: a Ray head on loopback, the `tandem` CLI against it, and
`tandem gateway` processes attached to shared pools (tandem.bench.pools, overlap and pools_chaos).

Each is a separate process, as in a deployment, started with this Python's own `tandem` and `ray` commands.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

from tandem.client import TandemClient
from tandem.models.store import CALIBRATION_ENV
from tandem.sessions.embedded import free_port

BIN = Path(sys.executable).parent
SERVING = 1  # grpc.health.v1 HealthCheckResponse.SERVING
LISTENING = "serving tandem.v1.GenerationService on"  # the line a gateway prints once its port is bound
RAY_STARTED = "Ray runtime started."  # what `ray start` prints once its head's services are up, before --block


class Gateway(NamedTuple):
    address: str  # HOST:PORT of its gRPC service
    process: subprocess.Popen


def ray_env(address: str) -> dict[str, str]:
    """This process's environment pointed at the Ray head on `address`."""
    # Not this process's own Ray settings (a local Ray started here turns token auth on): the loopback head has none.
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return inherited | {"RAY_ADDRESS": address, "RAY_AUTH_MODE": "disabled",
                        "TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0"}


def run_tandem(address: str, *args: str, timeout: float | None = None) -> str:
    """`tandem ARGS` against the cluster; its stdout. A failure raises RuntimeError with the end of its stderr."""
    done = subprocess.run([str(BIN / "tandem"), *args], env=ray_env(address), capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"tandem {' '.join(args)}: {done.stderr[-2000:]}")
    return done.stdout


def pools_status(address: str, pools: str, timeout: float | None = None) -> dict:
    """`tandem pools status --json`: the pools' workers with their cumulative counters."""
    return json.loads(run_tandem(address, "pools", "status", "--name", pools, "--json", timeout=timeout))


def ray_head_command(port: int, temp_dir: str, cpus: int = 4, client_port: int | None = None) -> list[str]:
    """`ray start` for a head of our own on loopback; --block: terminating the process stops this head alone. The
    ports Ray would otherwise fix (its client server, the dashboard agent) are free ones, so heads never clash;
    `client_port`: its Ray Client server's port instead (for `ray://127.0.0.1:PORT`)."""
    return [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
            f"--num-cpus={cpus}", "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}",
            f"--ray-client-server-port={client_port or free_port()}", f"--dashboard-agent-listen-port={free_port()}"]


def start_ray_head(temp_dir: str, env: Callable[[str], dict[str, str]] = ray_env, cpus: int = 4,
                   log: Path | None = None, tries: int = 3, timeout_s: float = 120.0,
                   client_port: int | None = None) -> tuple[subprocess.Popen, str]:
    """A Ray head of our own on a free loopback port and its address HOST:PORT, once `ray start` says it started.
    `env(address)`: the head's environment; `log`: its output (else a file in `temp_dir`); `client_port`: its Ray
    Client server's port (ray_head_command). A port free when picked may be taken by another process's Ray before
    this head binds it, and the head then exits: it is tried again on a fresh port, `tries` times in all;
    RuntimeError after that."""
    log = log or Path(temp_dir) / "ray-head.out"
    for _ in range(tries):
        port = free_port()
        address = f"127.0.0.1:{port}"
        written = log.stat().st_size if log.exists() else 0
        with log.open("a") as output:
            head = subprocess.Popen(ray_head_command(port, temp_dir, cpus, client_port), env=env(address),
                                    stdout=output, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while head.poll() is None and time.monotonic() < deadline:  # a head that exits ends the wait at once
            with log.open() as output:  # this try's output only: an earlier try's head may have said it started
                output.seek(written)
                if RAY_STARTED in output.read():
                    return head, address
            time.sleep(0.2)
        head.terminate()
        head.wait(timeout=120)
    raise RuntimeError(f"no Ray head started in {tries} tries (see {log})")


def start_checkout_head(services: str, cpus: int = 4) -> tuple[subprocess.Popen, str]:
    """A Ray head of our own (start_ray_head) whose workers import the tandem in `services`, a checkout's services/
    directory. Benchmarks that compare checkouts start one per checkout: a worker imports whichever tandem its head's
    environment finds first, and that is this environment's (an editable install) unless PYTHONPATH says otherwise."""
    services = os.path.abspath(services)
    return start_ray_head(tempfile.mkdtemp(prefix="tandem-head-"), cpus=cpus,
                          env=lambda address: ray_env(address) | {"PYTHONPATH": services})


@contextlib.contextmanager
def checkout_heads(checkouts: Sequence[str], cpus: int = 4) -> Iterator[dict[str, str]]:
    """{checkout: its head's address}: a head per checkout (start_checkout_head), every one stopped on exit."""
    heads: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        for services in checkouts:
            heads[services] = start_checkout_head(services, cpus)
        yield {services: address for services, (_, address) in heads.items()}
    finally:
        for head, _ in heads.values():
            head.terminate()
            head.wait(timeout=120)


def start_gateway(address: str, pools: str, extra: Sequence[str] = (), log: Path | None = None,
                  started: list[subprocess.Popen] | None = None, timeout_s: float = 300) -> Gateway:
    """`tandem gateway --pools POOLS EXTRA` on a free port, returned once its health check says SERVING.

    `log`: where its stderr goes (else nowhere). `started`: the process is appended as soon as it exists, so the
    caller's cleanup stops it even when it never turns ready."""
    process = subprocess.Popen([str(BIN / "tandem"), "gateway", "--pools", pools, "--port", "0", "--metrics-port",
                                "-1", *extra], env=ray_env(address), stdout=subprocess.PIPE,
                               stderr=log.open("w") if log else subprocess.DEVNULL, text=True)
    if started is not None:
        started.append(process)
    return Gateway(wait_serving(process, log, timeout_s), process)


def wait_serving(process: subprocess.Popen, log: Path | None = None, timeout_s: float = 300,
                 poll_s: float = 0.2) -> str:
    """The gRPC address of a `tandem gateway` or `tandem serve` process (its stdout a text pipe), once its readiness
    says SERVING. RuntimeError when it exits first or `timeout_s` passes; `log`: where its stderr went."""
    where = f" (see {log})" if log else ""
    lines: queue.Queue[str] = queue.Queue()  # read on a thread so that the wait has a deadline; "" marks EOF
    threading.Thread(target=lambda: [*map(lines.put, process.stdout), lines.put("")], daemon=True).start()
    deadline, line = time.monotonic() + timeout_s, "-"
    while line and LISTENING not in line:
        line = lines.get(timeout=max(0.01, deadline - time.monotonic()))  # queue.Empty at the deadline
    if not line:
        raise RuntimeError(f"the server exited before listening{where}")
    target = line.split(" on ")[1].split()[0]
    with TandemClient(target, timeout=10) as client:
        while client.health_status("tandem.v1.GenerationService") != SERVING:
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError(f"the server never turned ready{where}")
            time.sleep(poll_s)
    return target


@contextlib.contextmanager
def serve_process(flags: Sequence[str], log: Path, pythonpath: str | None = None, timeout_s: float = 3600,
                  costs_file: str = "", http_port: int = -1) -> Iterator[tuple[str, float]]:
    """`tandem serve FLAGS` (Ray, its pools and a gateway on a free port; no metrics, and the HTTP API on `http_port`
    where one is given) in a fresh interpreter, on `pythonpath`'s checkout if given, its stderr in `log`: yields its
    address and the seconds from its start until its readiness said SERVING (both APIs' readiness), and stops it
    (SIGTERM) on leaving. `costs_file`: its default calibration file ($TANDEM_CALIBRATION_FILE), used where FLAGS
    name none; '' (the default): it calibrates at every start, as a measured start should."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"HF_HUB_OFFLINE": "1",
                                                                              CALIBRATION_ENV: costs_file}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    began = time.monotonic()
    with log.open("w") as errors:
        process = subprocess.Popen([sys.executable, "-m", "tandem", "serve", *flags, "--port", "0", "--metrics-port",
                                    "-1", "--http-port", str(http_port)], env=env, stdout=subprocess.PIPE,
                                   stderr=errors, text=True)
    try:
        address = wait_serving(process, log, timeout_s=timeout_s)
        yield address, round(time.monotonic() - began, 2)
    finally:
        process.terminate()
        process.wait(timeout=300)


def greedy_streams(addresses: Sequence[str], prompts: Sequence, max_tokens: int) -> dict:
    """Every prompt as its own greedy stream at once, prompt i through gateway i mod len(addresses): wall seconds,
    tokens, tokens/s, the speculation totals and each stream's token ids (to compare outputs across configurations)."""
    outputs: dict[int, list[int]] = {}
    stats: dict[int, object] = {}

    def one(index: int) -> None:
        with TandemClient(addresses[index % len(addresses)], timeout=900) as client:
            ids = []
            for item in client.generate(**prompts[index].request_input(), temperature=0.0, max_tokens=max_tokens,
                                        ignore_eos=True):
                ids += list(getattr(item, "token_ids", []))
                if hasattr(item, "speculation"):
                    stats[index] = item.speculation
            outputs[index] = ids

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    tokens = sum(len(ids) for ids in outputs.values())
    return {"seconds": round(seconds, 3), "tokens": tokens, "tok_s": round(tokens / seconds, 3),
            "drafted": sum(s.drafted_tokens for s in stats.values()),
            "accepted": sum(s.accepted_tokens for s in stats.values()),
            "rounds": sum(s.rounds for s in stats.values()),
            "outputs": [outputs.get(i, []) for i in range(len(prompts))]}
