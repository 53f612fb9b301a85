"""`tandem keys create`: a new API key for a tenant, its hash appended to a keys file (`--api-keys`)."""

from __future__ import annotations

import argparse
import sys


def add_keys_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("keys")
    commands = parser.add_subparsers(dest="keys_command", required=True, metavar="COMMAND")
    create = commands.add_parser("create", help="make a key for a tenant; prints it once, stores only its hash")
    create.add_argument("--tenant", required=True, help="the tenant the key acts as (its requests' namespace)")
    create.add_argument("--file", required=True, metavar="FILE", help="the keys file to append to (made if missing)")
    create.add_argument("--max-concurrency", type=int, default=None, metavar="N",
                        help="the tenant's requests in flight at once (default: no cap beyond the gateway's queue)")
    create.add_argument("--priority", type=int, default=0, metavar="P",
                        help="added to the priority of each of the tenant's requests: lower runs first, so keys of "
                             "a higher P run behind those of a lower one (default: 0)")
    create.set_defaults(handler=run_create)


def run_create(args: argparse.Namespace) -> int:
    from tandem.gateway.auth import create_key

    key = create_key(args.file, args.tenant, args.max_concurrency, args.priority)
    # The key alone on stdout (scripts capture it); it cannot be shown again: only its hash is kept.
    print(key)
    print(f"tandem: key for tenant {args.tenant!r} added to {args.file}; it is shown only now", file=sys.stderr)
    return 0
