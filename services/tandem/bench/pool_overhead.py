"""Per-call overhead of the two ways to expose a worker: a named detached actor and a Ray Serve deployment.

Both run the same trivial method on a round's worth of messages (8 VerifyRequests, 5 draft tokens each), so the
difference is transport and routing, not work. Blocks of calls alternate between the two; JSON on stdout (and
--json PATH). Ray Serve comes with the serve-compare extra (`pip install -e ".[serve-compare]"`):

    python -m tandem.bench.pool_overhead --calls 200 --blocks 6 --json docs/bench/pool-overhead-v1.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import ray

from tandem.cli.options import (
    DefaultsHelpFormatter,
    add_json_option,
    at_least,
    refuse_bad_values,
    wants_text,
    write_json,
)
from tandem.core.config import SamplingParams
from tandem.core.protocol import DraftProposal, VerifyRequest


class Echo:
    def verify(self, requests: list) -> int:
        return len(requests)


def _requests() -> list[VerifyRequest]:
    return [VerifyRequest(f"seq-{i}", 100, [1234], DraftProposal(tokens=[11, 12, 13, 14, 15]),
                          SamplingParams(temperature=0.0, max_tokens=128), f"session-{i}") for i in range(8)]


def _block(call, calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1e6)
    return times


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse bad values before Ray starts: one line naming the flag, exit status 2, as the tandem CLI does. The
    p90 needs at least two calls per method."""
    checks = [*at_least(args, calls=1, blocks=1),
              ("calls", args.calls * args.blocks >= 2,
               f"with --blocks {args.blocks}, must be at least 2 (the p90 needs 2 calls a method), got {args.calls}")]
    refuse_bad_values(parser, checks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--calls", type=int, default=200, help="calls per block")
    parser.add_argument("--blocks", type=int, default=6, help="blocks per method, alternated")
    add_json_option(parser, "the report")
    args = parser.parse_args(argv)
    _check_args(parser, args)

    from ray import serve

    # address="local": always a cluster of our own on loopback, never one this machine already runs (RAY_ADDRESS or
    # `ray start`), which refuses num_cpus and would carry the benchmark's detached actor and Serve app.
    ray.init(address="local", num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             configure_logging=False, namespace="tandem-bench")
    actor = ray.remote(Echo).options(name="echo", lifetime="detached", max_concurrency=64).remote()
    handle = serve.run(serve.deployment(Echo, max_ongoing_requests=64).bind(), name="echo", route_prefix=None)
    payload = _requests()
    methods = {"detached_actor": lambda: ray.get(actor.verify.remote(payload)),
               "serve_deployment": lambda: handle.verify.remote(payload).result()}
    for call in methods.values():  # warm-up: connections, workers' imports
        _block(call, 20)
    samples: dict[str, list[float]] = {name: [] for name in methods}
    for block in range(args.blocks):
        for name in (list(methods) if block % 2 == 0 else list(reversed(methods))):
            samples[name] += _block(methods[name], args.calls)
    serve.shutdown()
    ray.kill(actor)
    ray.shutdown()
    report = {
        "command": "python -m tandem.bench.pool_overhead " + " ".join(sys.argv[1:]),
        "payload": "8 VerifyRequests with 5 draft tokens each",
        "median_us": {name: round(statistics.median(v), 1) for name, v in samples.items()},
        "p90_us": {name: round(statistics.quantiles(v, n=10)[-1], 1) for name, v in samples.items()},
        "calls": {name: len(v) for name, v in samples.items()},
    }
    report["serve_over_actor_median"] = round(report["median_us"]["serve_deployment"]
                                              / report["median_us"]["detached_actor"], 2)
    if wants_text(args):
        print(json.dumps(report, indent=2))
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
