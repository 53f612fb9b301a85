"""The Redis flags of the commands that keep state in Redis (`tandem serve`, `tandem gateway`, `tandem canary`): where
it lives and the credentials to reach it, folded into one URL for the store to open.
"""

from __future__ import annotations

import argparse
import os

from tandem.errors import InvalidArgument

SESSIONS_REDIS = ("session state store, redis://[:PASSWORD@]host:port/db or rediss:// for TLS (default: $REDIS_URL, "
                  "else an embedded redis-server on 127.0.0.1 with a random password)")


def add_redis_options(parser: argparse.ArgumentParser, url_help: str = SESSIONS_REDIS) -> None:
    """Where session state (or what `url_help` says) lives, and the credentials to reach it (kept off the command line
    where possible)."""
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL"), help=url_help)
    parser.add_argument("--redis-password-file", default=os.environ.get("TANDEM_REDIS_PASSWORD_FILE"),
                        metavar="FILE", help="the Redis password, from a file (default: "
                        "$TANDEM_REDIS_PASSWORD_FILE; else $TANDEM_REDIS_PASSWORD, else the URL's own)")
    parser.add_argument("--redis-ca", default=os.environ.get("TANDEM_REDIS_CA"), metavar="FILE",
                        help="PEM CA bundle that signed the rediss:// server's certificate (default: $TANDEM_REDIS_CA, "
                             "else the system's CAs)")


def session_store_url(args: argparse.Namespace) -> str | None:
    """--redis-url with the password and CA of the other flags folded in (None: the embedded Redis)."""
    from tandem.sessions.connection import configured_password, with_credentials

    if not args.redis_url or args.redis_url == "memory":
        # Credentials for no URL are a URL left out (a typo'd variable, a missing flag): the process would run on
        # a store of its own and its gateways would not share sessions, with nothing said.
        store = "its sessions live in its memory" if args.redis_url else "it runs an embedded Redis of its own"
        for field, value in (("redis_password_file", args.redis_password_file), ("redis_ca", args.redis_ca)):
            if value:
                raise InvalidArgument(f"{field}: given for no --redis-url (or $REDIS_URL), where {store}; pass the "
                                      f"URL of the Redis it is for")
        return args.redis_url or None
    return with_credentials(args.redis_url, configured_password(args.redis_password_file), args.redis_ca)
