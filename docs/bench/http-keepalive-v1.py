"""Keep-alive HTTP latency of one gateway over the tiny pair: 60 GET /health and 20 one-token completions on one
connection, and of 5 streamed completions of 64 tokens the first token and the whole stream, medians in ms (JSON on
stdout). From the repository root: `PYTHONPATH=services python
docs/bench/http-keepalive-v1.py`."""

import json
import statistics
import sys
import tempfile
import time

import httpx
import torch

sys.path.insert(0, "tests")
from gateway_harness import ServerThread, tiny_backend
from tandem.models.loader import load_model
from tandem.models.tiny import make_tiny


def load(path):
    return load_model(str(path), device=torch.device("cpu"), dtype=torch.float32, progress=False)


def median_ms(call, times: int) -> float:
    took = []
    for _ in range(times):
        started = time.perf_counter()
        call()
        took.append(time.perf_counter() - started)
    return statistics.median(took) * 1e3


dirs = make_tiny(tempfile.mkdtemp(), seed=0)
server = ServerThread(tiny_backend(load(dirs.target), load(dirs.draft)), http_port=0)
try:
    with httpx.Client(base_url=server.gateway.http_url) as client:
        client.get("/health")
        health = median_ms(lambda: client.get("/health"), 60)
        completion = median_ms(lambda: client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1,
                                                                            "temperature": 0}), 20)
        first, whole = [], []
        for _ in range(5):
            body = {"prompt": "hi", "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": True}
            sent = time.perf_counter()
            with client.stream("POST", "/v1/completions", json=body) as stream:
                arrivals = [time.perf_counter() - sent for line in stream.iter_lines() if line.startswith("data: ")]
            first.append(arrivals[0])
            whole.append(arrivals[-1])
    print(json.dumps({"health_p50_ms": round(health, 2), "completion_p50_ms": round(completion, 2),
                      "stream_first_token_p50_ms": round(statistics.median(first) * 1e3, 2),
                      "stream_whole_p50_ms": round(statistics.median(whole) * 1e3, 2)}))
finally:
    server.stop()
