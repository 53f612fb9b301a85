"""`tandem generate --address HOST:PORT`: stream one prompt from a running gateway, same output as local generate.

Needs only the client install (grpcio, protobuf): nothing here imports torch. gRPC and the client are imported
when a remote generation runs, so that `tandem generate --help` does not wait for them."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING

from tandem.cli.options import wants_text
from tandem.cli.outcome import print_outcome
from tandem.cli.sampling import prediction_text
from tandem.errors import TandemError

if TYPE_CHECKING:
    from tandem.client import SpeculationStats, TandemClient, Usage

API_KEY_ENV = "TANDEM_API_KEY"  # read from the environment, so the key stays out of `ps` and shell history


def add_address_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=None, metavar="HOST:PORT",
                        help="generate on a running `tandem serve` instead of loading models here "
                             "(model options are then ignored)")
    parser.add_argument("--tls", action="store_true", help="with --address: connect over TLS")
    parser.add_argument("--root-certificates", default=None, metavar="PEM",
                        help="with --tls: CA certificates to verify the server with (default: system roots)")
    parser.add_argument("--client-key", default=None, metavar="PEM", help="with --tls: client key (mutual TLS)")
    parser.add_argument("--client-certificate", default=None, metavar="PEM",
                        help="with --tls: client certificate chain (mutual TLS)")


def stats_dict(stats: SpeculationStats, usage: Usage) -> dict:
    """The server's SpeculationStats (and Usage's prediction counts) under the key names of the in-process engine's
    stats."""
    return {
        "rounds": stats.rounds,
        "fallback_rounds": stats.fallback_rounds,
        "drafted": stats.drafted_tokens,
        "accepted": stats.accepted_tokens,
        "acceptance_rate": round(stats.acceptance_rate, 4),
        "mean_accepted_length": round(stats.mean_accepted_length, 4),
        "acceptance_per_position": [round(a, 4) for a in stats.acceptance_per_position],
        "draft_failures": stats.draft_failures,
        "predicted_rounds": stats.predicted_rounds,
        "accepted_prediction_tokens": usage.accepted_prediction_tokens,
        "rejected_prediction_tokens": usage.rejected_prediction_tokens,
        "lookup_rounds": stats.lookup_rounds,
        "accepted_lookup_tokens": stats.accepted_lookup_tokens,
        "rejected_lookup_tokens": stats.rejected_lookup_tokens,
    }


def client_for(args: argparse.Namespace) -> TandemClient:
    from tandem.client import TandemClient

    try:
        return TandemClient(args.address, tls=args.tls, root_certificates=args.root_certificates,
                            private_key=args.client_key, certificate_chain=args.client_certificate,
                            api_key=os.environ.get(API_KEY_ENV) or None)
    except OSError as exc:  # a certificate file that cannot be read
        raise TandemError(f"{exc.filename}: {exc.strerror}") from None


def run_remote_generate(args: argparse.Namespace) -> int:
    import grpc

    from tandem.cli.formats import response_format
    from tandem.client import Collector
    from tandem.v1 import generation_pb2 as pb

    wanted = response_format(args)  # a schema that is not JSON fails before connecting
    collector = Collector()
    started = time.perf_counter()
    first_token_at = None
    with client_for(args) as client:
        try:
            for item in client.generate(None if args.chat else args.prompt,
                                        chat=[("user", args.prompt)] if args.chat else None,
                                        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                        min_p=args.min_p,
                                        seed=args.seed, max_tokens=args.max_tokens, stop=args.stop,
                                        stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos,
                                        repetition_penalty=args.repetition_penalty,
                                        presence_penalty=args.presence_penalty,
                                        frequency_penalty=args.frequency_penalty,
                                        response_format=wanted, min_tokens=args.min_tokens or None,
                                        prediction=prediction_text(args),
                                        speculation="off" if args.no_spec else "auto"):
                collector.add(item)
                if isinstance(item, pb.Complete):
                    continue
                first_token_at = first_token_at or time.perf_counter()
                if wants_text(args) and item.text:
                    sys.stdout.write(item.text)
                    sys.stdout.flush()
        except grpc.RpcError as exc:
            raise TandemError(f"{args.address}: {exc.code().name}: {exc.details()}") from exc
    elapsed = time.perf_counter() - started
    try:
        result = collector.result()
    except RuntimeError:
        raise TandemError(f"{args.address}: the stream ended without a result") from None
    print_outcome(args.json, result.text, result.token_ids, result.finish_reason, result.usage.prompt_tokens,
                  elapsed, first_token_at and first_token_at - started, not args.no_spec,
                  stats_dict(result.speculation, result.usage), request_id=result.request_id)
    return 0
