"""A proxy's pooled connection reused after it sat idle: does the gateway's HTTP server still hold it?

Proxies and load balancers keep idle connections to a backend (AWS ALB and nginx 60 s, Google Cloud's load balancers
600 s) and send the next request on one without knowing the backend closed it; a POST that meets a closed connection
comes back to the client as a 502 or 503, since it is not retried. This opens a gateway (the tiny pair, loopback) per
keep-alive setting, sends a request on each of several connections, leaves each idle for a while, then sends a second
request on the same connection and records whether it was answered.

    PYTHONPATH=services python docs/bench/http-keep-alive-v1.py out.json [idle seconds ...]
"""

from __future__ import annotations

import json
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

import torch

from gateway_harness import ServerThread, tiny_backend
from tandem.models.loader import load_model
from tandem.models.tiny import make_tiny

REQUEST = (b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n%s")
BODY = json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}).encode()


def answered(sock: socket.socket) -> bool:
    """Send one completion on `sock`; True when a 200 came back on it."""
    try:
        sock.sendall(REQUEST % (len(BODY), BODY))
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(65536)
            if not chunk:
                return False
            head += chunk
        status = int(head.split(b" ", 2)[1])
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(
            b"content-length")))
        body = head.split(b"\r\n\r\n", 1)[1]
        while len(body) < length:
            body += sock.recv(65536)
        return status == 200
    except OSError:
        return False


def reuse(port: int, idle_s: float, out: dict) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        first = answered(sock)
        time.sleep(idle_s)
        out[idle_s] = {"first": first, "after_idle": answered(sock)}


def main() -> None:
    path = sys.argv[1]
    idles = [float(x) for x in sys.argv[2:]] or [4.0, 6.0, 30.0, 65.0]
    with tempfile.TemporaryDirectory() as tmp:
        tiny = make_tiny(Path(tmp) / "tiny", seed=0)
        target, draft = (load_model(str(path), device=torch.device("cpu"), dtype=torch.float32)
                         for path in (tiny.target, tiny.draft))
        settings = {"uvicorn default (5 s)": 5.0, "tandem default": None}
        results = {}
        for name, keep_alive in settings.items():
            options = {} if keep_alive is None else {"http_keep_alive_s": keep_alive}
            server = ServerThread(tiny_backend(target, draft), http_port=0, **options)
            try:
                port = server.gateway.http_port
                out: dict = {}
                threads = [threading.Thread(target=reuse, args=(port, idle, out)) for idle in idles]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                results[name] = {"keep_alive_s": server.gateway.options.http_keep_alive_s,
                                 "by_idle_s": {str(idle): out[idle] for idle in idles}}
                print(name, results[name], flush=True)
            finally:
                server.stop()
    Path(path).write_text(json.dumps({"idle_s": idles, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
