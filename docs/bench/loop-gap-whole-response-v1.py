"""How long a gateway's other clients wait while it answers one huge whole (non-streamed) response: a completion of 16
choices echoing a 3000-token prompt with 20 logprobs a token (29.8 MB of JSON), over the tiny pair, with the engine
in this process (as `tandem serve --in-process`). Meanwhile a gRPC client asks the readiness health check every 20 ms;
the figure is the longest time between two answers (the 20 ms sleep included, so a hold that begins while the client
sleeps counts too), beside the collector's runs over 30 ms. Four arms, alternated, `--repeats` each: the prompt
scores built with the cyclic collector running or paused (core.prompt_logprobs), the body encoded a choice a call or
in bounded parts (gateway.openai.json_parts).

    PYTHONPATH=services python docs/bench/loop-gap-whole-response-v1.py OUT.json [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # the gateway harness
import httpx
import torch

from gateway_harness import ServerThread
from hardening_harness import longest_between_health_answers, named_loader
from tandem.core import gc_pause, prompt_logprobs
from tandem.gateway.openai import delivery, json_parts
from tandem.gateway.validate import GatewayLimits
from tandem.models.loader import load_model
from tandem.models.tiny import make_tiny

BODY = {"prompt": [5] * 3000, "max_tokens": 1, "n": 16, "echo": True, "logprobs": 20, "temperature": 1.0}


def per_choice(payload: dict) -> bytes:
    """The encoding before json_parts: one json.dumps call a top-level list item (a whole choice)."""
    encode = json_parts._json
    return b"{" + b",".join(encode(key) + (b":[" + b",".join(encode(item) for item in value) + b"]"
                                           if isinstance(value, list) else b":" + encode(value))
                            for key, value in payload.items()) + b"}"


ARMS = {  # arm: (the collector pause prompt scores are built under, the whole body's encoder)
    "collector running, a call a choice": (contextlib.nullcontext, per_choice),
    "collector running, parts": (contextlib.nullcontext, json_parts.json_in_parts),
    "collector paused, a call a choice": (gc_pause.collector_paused, per_choice),
    "collector paused, parts": (gc_pause.collector_paused, json_parts.json_in_parts),
}


class Collections:
    """The cyclic collector's runs over 30 ms: (generation, seconds, thread)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, float, str]] = []
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif (seconds := time.perf_counter() - self._started) > 0.03:
            self.seen.append((info["generation"], round(seconds, 3), threading.current_thread().name))


def one(server: ServerThread, collections: Collections) -> tuple[float, float, list]:
    """(the longest time between two health answers, the huge request's seconds, collections over 30 ms)."""
    collections.seen.clear()
    started = time.monotonic()
    longest, response = longest_between_health_answers(server.address, lambda: httpx.post(
        f"{server.gateway.http_url}/v1/completions", json=BODY, timeout=300))
    seconds = time.monotonic() - started
    assert response.status_code == 200 and len(response.content) > 29e6
    return round(longest, 3), round(seconds, 2), list(collections.seen)


@contextlib.contextmanager
def tiny_server() -> Iterator[tuple[ServerThread, Collections]]:
    """A gateway over the tiny pair in this process, the collector's long runs watched, one warm-up request made."""
    with tempfile.TemporaryDirectory() as scratch:
        tiny = make_tiny(Path(scratch) / "tiny", seed=0)
        target, draft = (load_model(str(path), device=torch.device("cpu"), dtype=torch.float32, progress=False)
                         for path in (tiny.target, tiny.draft))
        server = ServerThread(named_loader(target, draft, "tiny-target"), http_port=0,
                              limits=GatewayLimits(max_prompt_tokens=4000))
        try:
            collections = Collections()
            one(server, collections)  # warm-up
            yield server, collections
        finally:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, list] = {arm: [] for arm in ARMS}
    with tiny_server() as (server, collections):
        for repeat in range(args.repeats):
            for arm in (list(ARMS) if repeat % 2 == 0 else list(reversed(ARMS))):
                prompt_logprobs.collector_paused, delivery.json_in_parts = ARMS[arm]
                results[arm].append(one(server, collections))
                print(arm, results[arm][-1], flush=True)
    summary = {arm: {"longest_gap_s": max(run[0] for run in runs),
                     "median_longest_gap_s": sorted(run[0] for run in runs)[len(runs) // 2],
                     "median_request_s": sorted(run[1] for run in runs)[len(runs) // 2], "runs": runs}
               for arm, runs in results.items()}
    with open(args.out, "w") as out:
        json.dump({"request": BODY | {"prompt": "3000 tokens"}, "arms": summary}, out, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
