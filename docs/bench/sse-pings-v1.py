"""An HTTP stream behind nginx that sends nothing for a while (a request waiting for a place, a long prefill on a CPU):
does it reach its client whole?

nginx (as Kubernetes' ingress-nginx runs it) ends a proxied response when a read from the backend waits longer than
proxy_read_timeout, 60 s by default; AWS ALB's idle timeout is 60 s too. This serves the tiny pair behind a real nginx
with its defaults (buffering off, as for SSE), holds one engine step for `silent` seconds, before the first token or
after two steps of tokens, and streams one chat completion through nginx with the gateway's SSE pings off
(`--sse-ping 0`, as the gateway was before them) and at their default.

    apt-get install nginx-light     # (Debian)
    PYTHONPATH=services python docs/bench/sse-pings-v1.py out.json [silent_s]
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

import httpx
import torch

from gateway_harness import ServerThread
from hardening_harness import named_loader
from tandem.gateway.options import GatewayOptions
from tandem.models.loader import load_model
from tandem.models.tiny import make_tiny

NGINX = """worker_processes 1;
error_log {dir}/error.log;
pid {dir}/nginx.pid;
events {{}}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://127.0.0.1:{backend};
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""
REQUEST = {"model": "tiny-target", "messages": [{"role": "user", "content": "def add(a, b):"}], "temperature": 0,
           "max_tokens": 8, "ignore_eos": True, "stream": True}


def main() -> None:
    path = sys.argv[1]
    silent_s = float(sys.argv[2]) if len(sys.argv) > 2 else 75.0
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny = make_tiny(Path(tmp) / "tiny", seed=0)
        target, draft = (load_model(str(p), device=torch.device("cpu"), dtype=torch.float32)
                         for p in (tiny.target, tiny.draft))
        for at_step, where in ((1, "before the first token"), (3, "after two steps of tokens")):
            for ping_s in (0.0, GatewayOptions().sse_ping_s):
                run = one_stream(target, draft, Path(tmp), silent_s, at_step, ping_s)
                runs.append({"silent": where, "sse_ping_s": ping_s, **run})
                print(json.dumps(runs[-1]), flush=True)
    Path(path).write_text(json.dumps({"silent_s": silent_s, "nginx": nginx_version(),
                                      "proxy_read_timeout_s": 60, "runs": runs}, indent=1) + "\n")


def one_stream(target, draft, tmp: Path, silent_s: float, at_step: int, ping_s: float) -> dict:
    steps = [0]

    def hold(engine) -> None:
        if engine.sequences:
            steps[0] += 1
            if steps[0] == at_step:
                time.sleep(silent_s)

    server = ServerThread(named_loader(target, draft, "tiny-target", "tiny-draft", hold), http_port=0,
                          sse_ping_s=ping_s, stall_timeout=silent_s + 60)
    proxy_dir = Path(tempfile.mkdtemp(dir=tmp))
    port = free_port()
    (proxy_dir / "nginx.conf").write_text(NGINX.format(dir=proxy_dir, port=port, backend=server.gateway.http_port))
    proxy = subprocess.Popen(["nginx", "-p", str(proxy_dir), "-c", str(proxy_dir / "nginx.conf"), "-g",
                              "daemon off;"])
    lines, status, error, headers_s = [], None, None, None
    try:
        wait_for_port(port)
        started = time.monotonic()
        try:
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=REQUEST,
                              timeout=silent_s + 60) as response:
                status, headers_s = response.status_code, time.monotonic() - started
                for line in response.iter_lines():
                    if line:
                        lines.append(line)
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"
        ended_s = time.monotonic() - started
    finally:
        proxy.terminate()
        proxy.wait()
        server.stop()
    return {"status": status, "headers_after_s": headers_s and round(headers_s, 1), "ended_after_s": round(ended_s, 1),
            "error": error,
            "pings": sum(line.startswith(":") for line in lines),
            "data_chunks": sum(line.startswith("data: {") for line in lines),
            "done": bool(lines) and lines[-1] == "data: [DONE]"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(port: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError("nginx did not listen")


def nginx_version() -> str:
    return subprocess.run(["nginx", "-v"], capture_output=True, text=True).stderr.strip()


if __name__ == "__main__":
    main()
