"""A client host that vanishes (a crash, a dropped NAT entry, a cable pulled) sends no FIN: its HTTP connection stays
open to the gateway, a whole response it waited for generated on to its end, and a stream's writes were
retransmitted for about 15 minutes. TCP keepalive and a user timeout on the gateway's HTTP sockets fail such a
connection, and its request ends, freeing its place and caches (gateway.openai.server).

Here the client runs in a network namespace of its own behind a veth pair, and the gateway's end of the link goes
down mid-request: the client's kernel can answer nothing. Scaled down: a probe after 1 s idle, then every second, 2
unanswered; without keepalive (the control) the request is still running 10 s later. Needs root, iproute2 and
util-linux (`.ci/run` runs the suite as root in a namespace of its own).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time

import pytest

from gateway_harness import ServerThread
from hardening_harness import named_loader
from tandem.gateway.openai import server as http_server


def _can_make_hosts() -> bool:
    if os.geteuid() != 0 or not all(shutil.which(tool) for tool in ("ip", "unshare", "nsenter")):
        return False
    return subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0


pytestmark = pytest.mark.skipif(not _can_make_hosts(), reason="needs root, iproute2 and util-linux to put a client "
                                "on a host of its own")

# The client: reads the gateway's URL, sends one long request (streamed or whole), says so, then reads on.
CLIENT = """
import json, sys, httpx
url, stream = sys.stdin.readline().strip(), sys.argv[1] == "stream"
body = {"model": "tiny-target", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3000,
        "ignore_eos": True, "stream": stream}
with httpx.Client(timeout=600) as client:
    if stream:
        with client.stream("POST", url, json=body) as response:
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    print("started", flush=True)
                    break
            for line in lines:
                pass
    else:
        print("started", flush=True)
        client.post(url, json=body)
"""


def _ip(*args: str, pid: int | None = None) -> None:
    command = ["ip", *args] if pid is None else ["nsenter", "-t", str(pid), "-n", "ip", *args]
    subprocess.run(command, check=True, capture_output=True)


@contextlib.contextmanager
def client_host(stream: bool):
    """(the client process, this side's address, this side's interface): the client in a namespace of its own,
    joined to this one by a veth pair on a /30 of its own."""
    link, subnet = f"tdc{os.getpid() % 100000}", f"10.213.{os.getpid() % 250}"
    client = subprocess.Popen(["unshare", "-n", sys.executable, "-c", CLIENT, "stream" if stream else "whole"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        # `unshare -n` makes the namespace, then runs the client under the same pid: a link moved to the pid before
        # that is moved to this namespace (seen in CI under load: the next `ip` in the client's found no device).
        ours, deadline = os.readlink("/proc/self/ns/net"), time.monotonic() + 30
        while os.readlink(f"/proc/{client.pid}/ns/net") == ours:
            assert time.monotonic() < deadline and client.poll() is None, "the client never left this namespace"
            time.sleep(0.01)
        _ip("link", "add", f"{link}a", "type", "veth", "peer", "name", f"{link}b")
        _ip("link", "set", f"{link}b", "netns", str(client.pid))
        _ip("addr", "add", f"{subnet}.1/30", "dev", f"{link}a")
        _ip("link", "set", f"{link}a", "up")
        _ip("addr", "add", f"{subnet}.2/30", "dev", f"{link}b", pid=client.pid)
        _ip("link", "set", f"{link}b", "up", pid=client.pid)
        yield client, f"{subnet}.1", f"{link}a"
    finally:
        client.kill()
        client.wait()
        subprocess.run(["ip", "link", "del", f"{link}a"], capture_output=True)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("keepalive", "ended"), [(True, True), (False, False)], ids=["keepalive", "none"])
def test_a_vanished_client_has_its_request_ended(tiny_models, monkeypatch, stream, keepalive, ended) -> None:
    monkeypatch.setattr(http_server, "KEEPALIVE_IDLE_S", 1)
    monkeypatch.setattr(http_server, "KEEPALIVE_INTERVAL_S", 1)
    monkeypatch.setattr(http_server, "KEEPALIVE_PROBES", 2)
    if not keepalive:
        monkeypatch.setattr(http_server, "_keepalive", lambda sock: None)
    target, draft, _ = tiny_models
    with client_host(stream) as (client, address, link):
        server = ServerThread(named_loader(target, draft, "tiny-target", "tiny-draft", lambda _: time.sleep(0.02)),
                              host=address, http_port=0)
        try:
            client.stdin.write(f"{server.gateway.http_url}/v1/chat/completions\n")
            client.stdin.flush()
            assert client.stdout.readline().strip() == "started"
            assert server.wait_for(lambda: bool(server.engine.sequences), timeout=10)
            time.sleep(1.5)  # (a whole response's connection idle past a probe, answered)
            _ip("link", "set", link, "down")
            assert server.wait_for(lambda: not server.engine.sequences, timeout=10) == ended
        finally:
            server.stop()
