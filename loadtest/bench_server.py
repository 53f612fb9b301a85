"""The server a loadtest benchmark measures (loadtest.api_compare, loadtest.security_bench): one `tandem serve
--in-process` started as a child process, waited on until gRPC and HTTP are ready, described (server_info) and
stopped; the command-line flags it reads, the machine's description for the report, and the progress log.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.metadata
import os
import platform
import signal
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

BIN = Path(sys.executable).parent
SERVING = 1  # grpc.health.v1 HealthCheckResponse.SERVING


def log(message: str) -> None:
    print(f"[api_compare {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Server:
    """`tandem serve --in-process` as a child process in a session of its own; stop() ends it (SIGTERM, then SIGKILL
    to its process group, which holds its embedded Redis) and is safe to call twice."""

    GRPC_LINE = "serving tandem.v1.GenerationService on "
    HTTP_LINE = "serving the OpenAI-compatible HTTP API on "

    def __init__(self, args: argparse.Namespace, log_path: Path, extra: list[str] = (), ca: str | None = None) -> None:
        """`extra`: more serve flags than args.serve_args; `ca`: the server speaks TLS with a certificate this PEM CA
        signed (the readiness checks connect with it)."""
        self.command = [str(BIN / "tandem"), "serve", "--in-process", "--host", "127.0.0.1", "--port", "0",
                        "--http-port", "0", "--no-metrics", "--dtype", args.dtype, "--grace", "5"]
        for flag, value in (("--target", args.target), ("--draft", args.draft), ("--threads", args.threads)):
            if value is not None:
                self.command += [flag, str(value)]
        self.command += args.serve_args.split() + list(extra)
        self.ca = ca
        self.log_path = log_path
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self.address = ""
        self.url = ""
        self.process: subprocess.Popen | None = None
        self._found = threading.Event()

    def start(self, timeout: float) -> None:
        env = os.environ | {"TOKENIZERS_PARALLELISM": "false"}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(self.command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, text=True, errors="replace",
                                        start_new_session=True)
        threading.Thread(target=self._drain, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not self._found.wait(0.2):
            self._check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server announced no addresses within {timeout:g} s{self._tail()}")
        log(f"server pid {self.process.pid}: gRPC {self.address}, HTTP {self.url}; waiting for readiness")
        self._wait_ready(deadline, timeout)

    def _drain(self) -> None:
        with self.log_path.open("w") as sink:
            for line in self.process.stdout:
                sink.write(line)
                sink.flush()
                self.tail.append(line.rstrip())
                if self.GRPC_LINE in line:
                    self.address = line.split(self.GRPC_LINE)[1].split()[0]
                elif self.HTTP_LINE in line:
                    self.url = line.split(self.HTTP_LINE)[1].split()[0].removesuffix("/v1")
                if self.address and self.url:
                    self._found.set()

    def _tail(self) -> str:
        return "; its last output:\n" + "\n".join(self.tail) if self.tail else ""

    def _check_alive(self) -> None:
        if self.process.poll() is not None:
            time.sleep(0.3)  # let the reader thread catch the last lines
            raise RuntimeError(f"the server exited with status {self.process.returncode}{self._tail()}")

    def _wait_ready(self, deadline: float, timeout: float) -> None:
        import grpc
        import httpx

        from tandem.client import READINESS_SERVICE, TandemClient

        verify = ssl.create_default_context(cafile=self.ca) if self.ca else True
        with TandemClient(self.address, timeout=5, tls=self.ca is not None, root_certificates=self.ca) as client, \
                httpx.Client(trust_env=False, timeout=5, verify=verify) as http:
            while True:
                self._check_alive()
                with contextlib.suppress(grpc.RpcError, httpx.HTTPError):
                    if (client.health_status(READINESS_SERVICE) == SERVING
                            and http.get(f"{self.url}/health").status_code == 200):
                        return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the server was not ready within {timeout:g} s{self._tail()}")
                time.sleep(0.5)

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        log(f"stopping the server (pid {process.pid})")
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def server_info(address: str) -> dict:
    from google.protobuf.json_format import MessageToDict

    from tandem.client import TandemClient

    with TandemClient(address, timeout=30) as client:
        info = MessageToDict(client.model_info(), preserving_proto_field_name=True)
    keep = ("target_model", "draft_model", "vocab_size", "max_k", "context_length", "draft_workers",
            "target_replicas")
    return {key: info[key] for key in keep if key in info}


def add_server_options(parser: argparse.ArgumentParser) -> None:
    """The flags Server reads: which models, dtype and threads `tandem serve` gets, and any more of its flags."""
    parser.add_argument("--target", default=None, help="target model (default: tandem serve's)")
    parser.add_argument("--draft", default=None, help="draft model (default: tandem serve's)")
    parser.add_argument("--dtype", default="bfloat16", help="the servers' dtype")
    parser.add_argument("--threads", type=int, default=None, help="each server's torch threads (default: all cores)")
    parser.add_argument("--serve-args", default="", help="more `tandem serve` flags, one string")


def machine() -> dict:
    cpu = ""
    with contextlib.suppress(OSError):
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "")
    versions = {}
    for package in ("torch", "transformers", "openai", "grpcio", "httpx"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[package] = importlib.metadata.version(package)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"nproc": usable, "cpu_count": os.cpu_count(), "cpu": cpu, "platform": platform.platform(),
            "python": platform.python_version(), "torch": versions.get("torch"), "versions": versions}
