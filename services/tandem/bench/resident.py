"""A benchmark worker that stays loaded: one process per system (or engine), started once and then asked for one run
at a time, so two systems' runs can alternate request by request instead of turn by turn.

The worker is any program run as `command JOB_PATH RESULT_FD`: it reads the job (JSON) from JOB_PATH, loads, writes
one JSON line to file descriptor RESULT_FD (what it loaded: versions, load seconds), then for each JSON line on its
stdin writes one JSON line back to RESULT_FD. Its stdout and stderr go to a log (vLLM's engine process writes there
too, which is why results travel on a pipe of their own); its lines that start with one of `echo`'s prefixes are
echoed as progress. Closing its stdin ends it. `serve` is that side of the protocol; this file imports nothing
outside the standard library, so a worker under another Python (vLLM's) loads it by path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO

_LOG_LOCK = threading.Lock()  # workers share one log file

Answer = Callable[[dict], dict]


def serve(load: Callable[[dict], tuple[dict, Answer]], argv: list[str] | None = None) -> None:
    """A worker's main: `load(job)` once, its description on the result pipe, then one answer per request line."""
    job_path, result_fd = (argv if argv is not None else sys.argv[1:])[:2]
    with open(job_path) as source:
        job = json.load(source)
    with os.fdopen(int(result_fd), "w") as results:
        loaded, answer = load(job)
        results.write(json.dumps(loaded) + "\n")
        results.flush()
        for line in sys.stdin:
            results.write(json.dumps(answer(json.loads(line))) + "\n")
            results.flush()


class Resident:
    def __init__(self, name: str, command: list[str], job: dict, log: Path, env: dict[str, str] | None = None,
                 echo: tuple[str, ...] = (), say: Callable[[str], None] = print) -> None:
        self.name = name
        self._tail: list[str] = []
        self._dir = tempfile.TemporaryDirectory()
        job_path = Path(self._dir.name) / "job.json"
        job_path.write_text(json.dumps(job))
        read_fd, write_fd = os.pipe()
        _write(log, f"\n==== {name}: {' '.join(command)} "
                    f"{json.dumps({k: v for k, v in job.items() if 'ids' not in k and k != 'texts'})[:300]}\n")
        self._proc = subprocess.Popen([*command, str(job_path), str(write_fd)], env=env, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      pass_fds=(write_fd,))
        os.close(write_fd)  # the worker holds the only write end: its exit ends our reads
        self._results: IO[str] = os.fdopen(read_fd)
        self._copier = threading.Thread(target=self._copy, args=(log, echo, say), daemon=True)
        self._copier.start()
        self.loaded: dict = self._read()

    def ask(self, request: dict) -> dict:
        """One run; its result. Raises RuntimeError, with the end of the worker's output, when the worker died."""
        try:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            pass  # the read below reports the exit
        return self._read()

    def close(self, timeout: float = 120.0) -> None:
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._results.close()
        self._copier.join(10)
        self._dir.cleanup()

    def __enter__(self) -> Resident:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read(self) -> dict:
        line = self._results.readline()
        if not line:
            code = self._proc.wait()
            self._copier.join(10)
            raise RuntimeError(f"{self.name} exited {code}:\n{''.join(self._tail)}")
        return json.loads(line)

    def _copy(self, log: Path, echo: tuple[str, ...], say: Callable[[str], None]) -> None:
        for line in self._proc.stdout:
            _write(log, line)
            self._tail = (self._tail + [line])[-25:]
            if echo and line.startswith(echo):
                say("  " + line.rstrip())


def _write(log: Path, text: str) -> None:
    with _LOG_LOCK, log.open("a") as sink:
        sink.write(text)
