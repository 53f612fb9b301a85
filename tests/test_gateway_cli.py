"""`tandem serve` as a real process, and remote `tandem generate --address` against it."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import psutil
import pytest

from tandem.cli.generate import add_generate_parser
from tandem.cli.main import main
from tandem.cli.remote import run_remote_generate
from tandem.client import TandemClient
from tandem.core import cpu_runtime
from tandem.gateway.options import GatewayOptions
from tandem.gateway.run import start_gateway
from tandem.gateway.server import READINESS_SERVICE, SERVING

SERVICES = Path(__file__).resolve().parent.parent / "services"
STARTUP_SECONDS = 120
KV_TOKENS = 4096
# The drain test's stream must end within the grace: the whole test (stream, drain, exit) takes 4 s here, but the
# CI cut a stream at 5 s (UNAVAILABLE) on a loaded machine. Whether the adaptive policy drafts follows the machine's
# timings, and the tests below need drafts (remote generate's stats, the draft cache's use): the server drafts a
# fixed k.
GRACE_SECONDS = 30


@pytest.fixture(scope="module")
def served(tiny_dirs):
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(SERVICES), os.environ.get("PYTHONPATH")])),
                        "TANDEM_PRELOAD": "1"}  # where tcmalloc and intel-openmp are installed, served on them
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem", "serve", "--target", str(tiny_dirs.target), "--draft", str(tiny_dirs.draft),
         "--port", "0", "--dtype", "float32", "--threads", "1", "--grace", str(GRACE_SECONDS), "--kv-tokens",
         str(KV_TOKENS), "--fixed-k", "3"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []

    def read_until_serving() -> None:
        while (line := proc.stdout.readline()) and len(lines) < 20:
            lines.append(line)
            if "serving" in line:
                return

    reader = threading.Thread(target=read_until_serving, daemon=True)
    reader.start()
    reader.join(STARTUP_SECONDS)
    if not lines or "serving" not in lines[-1]:
        proc.kill()
        pytest.fail(f"serve did not start: {lines} {proc.stderr.read()}")
    assert any("embedded Redis" in line for line in lines), "serve should start its own Redis without REDIS_URL"
    address = lines[-1].split(" on ")[1].split()[0]
    with TandemClient(address, timeout=5) as client:
        for _ in range(STARTUP_SECONDS * 4):
            try:
                if client.health_status(READINESS_SERVICE) == SERVING:
                    break
            except grpc.RpcError:
                pass
            threading.Event().wait(0.25)
    yield proc, address
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def _remote_args(address: str, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers()
    add_generate_parser(subparsers)
    return parser.parse_args(["generate", "def add(a, b):", "--address", address, "--temperature", "0",
                              "--max-tokens", "24", "--ignore-eos", *extra])


def test_remote_generate_matches_local_generate(served, tiny_dirs, capsys) -> None:
    _, address = served
    assert run_remote_generate(_remote_args(address, "--json")) == 0
    remote = json.loads(capsys.readouterr().out)
    assert run_remote_generate(_remote_args(address, "--json", "--no-spec")) == 0
    remote_plain = json.loads(capsys.readouterr().out)
    assert main(["generate", "def add(a, b):", "--target", str(tiny_dirs.target), "--draft", str(tiny_dirs.draft),
                 "--temperature", "0", "--max-tokens", "24", "--ignore-eos", "--dtype", "float32", "--json"]) == 0
    local = json.loads(capsys.readouterr().out)
    assert remote["token_ids"] == local["token_ids"] == remote_plain["token_ids"]
    assert remote["text"] == local["text"] and remote["finish_reason"] == "length"
    assert remote["stats"]["drafted"] > 0 and remote_plain["stats"]["drafted"] == 0
    assert remote["prompt_tokens"] == local["prompt_tokens"]
    assert run_remote_generate(_remote_args(address)) == 0
    streamed = capsys.readouterr()
    assert streamed.out.rstrip("\n") == local["text"] and "finish: length" in streamed.err


def test_kv_tokens_reaches_the_ray_workers_and_model_info_reports_their_usage(served) -> None:
    _, address = served
    with TandemClient(address, timeout=60) as client:
        _, complete = client.generate_text(prompt="hello", session_id="kv-cli", temperature=0.0, max_tokens=8)
        info = client.model_info()
    assert (info.draft_workers, info.target_replicas) == (1, 1)
    for kv in (info.target_kv, info.draft_kv):
        assert kv.capacity_tokens == KV_TOKENS and 0 <= kv.used_tokens <= kv.reserved_tokens <= KV_TOKENS, info
    # The session's caches stay on its workers: the target's always, the draft's if the round drafted.
    assert info.target_kv.used_tokens > 0
    assert (info.draft_kv.used_tokens > 0) == (complete.speculation.drafted_tokens > 0), (info, complete)


def test_remote_errors_and_busy_port(served) -> None:
    _, address = served
    with pytest.raises(Exception, match="INVALID_ARGUMENT: top_p"):
        run_remote_generate(_remote_args(address, "--top-p", "0"))
    host, port = address.rsplit(":", 1)
    with pytest.raises(OSError, match="cannot listen"):
        asyncio.run(start_gateway(lambda: None, GatewayOptions(host=host, port=int(port))))


def test_serve_runs_itself_again_on_the_cpu_preload_and_so_do_its_ray_workers(served) -> None:
    """With TANDEM_PRELOAD=1 on x86-64 Linux with tcmalloc and intel-openmp installed (CI installs both), `tandem
    serve` runs on them: the same process (exec) with LD_PRELOAD set, which the local Ray's workers inherit
    (core.cpu_runtime)."""
    proc, _ = served
    environment = cpu_runtime.preload_environment(os.environ | {"TANDEM_PRELOAD": "1"})
    preload = os.environ.get("LD_PRELOAD") or (environment or {}).get("LD_PRELOAD")
    if not preload:
        pytest.skip("no preload here: not x86-64 Linux, a GPU machine or neither library installed")
    expected = {"libiomp5": "libiomp5" in preload, "tcmalloc": "libtcmalloc" in preload}
    assert cpu_runtime.loaded(Path(f"/proc/{proc.pid}/maps").read_text()) == expected
    actors = (b"ray::DraftWorker", b"ray::TargetWorker")
    workers = [child.pid for child in psutil.Process(proc.pid).children(recursive=True)  # under its local Ray
               if Path(f"/proc/{child.pid}/cmdline").read_bytes().startswith(actors)]
    assert len(workers) == 2, workers
    for pid in workers:
        assert cpu_runtime.loaded(Path(f"/proc/{pid}/maps").read_text()) == expected


def test_sigterm_drains_and_exits_cleanly(served) -> None:
    proc, address = served
    with TandemClient(address, timeout=30) as client:
        stream = client.generate(prompt="hello", temperature=0.0, max_tokens=200, ignore_eos=True)
        next(stream)
        proc.send_signal(signal.SIGTERM)
        complete = list(stream)[-1]
    assert complete.usage.completion_tokens == 200
    assert proc.wait(GRACE_SECONDS + 30) == 0


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--draft-resources", "{draft_pool: 1}", "error: --draft-resources: not valid JSON"),
    ("--target-resources", '{"target_pool": -1}', "error: --target-resources: must map resource names to positive "
                                                   "amounts"),
    ("--target-resources", '["target_pool"]', "error: --target-resources: must map"),
    ("--kv-tokens", "-1", "error: --kv-tokens: must be non-negative"),
    ("--max-tokens-limit", "0", "error: --max-tokens-limit: must be at least 1, got 0"),  # its flag, not a field
    ("--default-max-tokens", "0", "error: --default-max-tokens: must be at least 1, got 0"),
])
def test_serve_rejects_bad_worker_resources_before_starting_anything(tiny_dirs, flag, value, message) -> None:
    proc = subprocess.run([sys.executable, "-m", "tandem", "serve", "--target", str(tiny_dirs.target), flag, value],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


@pytest.mark.parametrize("seconds", ["0", "-1"])
def test_a_gateway_refuses_a_draft_timeout_that_would_turn_speculation_off(seconds: str, capsys) -> None:
    """Every draft call would be late: refused before any cluster is joined, naming the flag."""
    assert main(["gateway", "--pools", "p", "--draft-timeout", seconds]) == 2
    error = capsys.readouterr().err.strip()
    assert error == f"error: --draft-timeout: must be more than 0 seconds, got {float(seconds)}"


