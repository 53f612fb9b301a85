"""`tandem generate --address HOST:PORT`: stream one prompt from a running gateway, same output as local generate."""

from __future__ import annotations

import argparse
import sys
import time

import grpc

from tandem.cli.common import print_outcome
from tandem.client import TandemClient
from tandem.errors import TandemError
from tandem.v1 import generation_pb2 as pb


def add_address_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=None, metavar="HOST:PORT",
                        help="generate on a running `tandem serve` instead of loading models here "
                             "(model options are then ignored)")


def stats_dict(stats: pb.SpeculationStats) -> dict:
    """The server's SpeculationStats under the key names of the in-process engine's stats."""
    return {
        "rounds": stats.rounds,
        "fallback_rounds": stats.fallback_rounds,
        "drafted": stats.drafted_tokens,
        "accepted": stats.accepted_tokens,
        "acceptance_rate": round(stats.acceptance_rate, 4),
        "mean_accepted_length": round(stats.mean_accepted_length, 4),
        "acceptance_per_position": [round(a, 4) for a in stats.acceptance_per_position],
        "draft_failures": stats.draft_failures,
    }


def run_remote_generate(args: argparse.Namespace) -> int:
    options = {
        "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed,
        "max_tokens": args.max_tokens, "stop": args.stop, "stop_token_ids": args.stop_token_id,
        "ignore_eos": args.ignore_eos, "speculation": "off" if args.no_spec else "auto",
    }
    if args.chat:
        options["chat"] = [("user", args.prompt)]
    else:
        options["prompt"] = args.prompt
    parts: list[str] = []
    token_ids: list[int] = []
    complete: pb.Complete | None = None
    started = time.perf_counter()
    first_token_at = None
    with TandemClient(args.address) as client:
        try:
            for item in client.generate(**options):
                if isinstance(item, pb.Complete):
                    complete = item
                    continue
                first_token_at = first_token_at or time.perf_counter()
                parts.append(item.text)
                token_ids.extend(item.token_ids)
                if not args.json and item.text:
                    sys.stdout.write(item.text)
                    sys.stdout.flush()
        except grpc.RpcError as exc:
            raise TandemError(f"{args.address}: {exc.code().name}: {exc.details()}") from exc
    elapsed = time.perf_counter() - started
    if complete is None:
        raise TandemError(f"{args.address}: the stream ended without a result")
    print_outcome(args.json, "".join(parts), token_ids, pb.FinishReason.Name(complete.finish_reason).lower(),
                  complete.usage.prompt_tokens, elapsed, first_token_at and first_token_at - started,
                  not args.no_spec, stats_dict(complete.speculation), request_id=complete.request_id)
    return 0
