"""How tandem reaches Redis: the URL with its credentials and TLS settings, kept out of logs and error messages.

Every Redis client in tandem (session store, canary store) is built with `redis.Redis.from_url`, so the password and
the TLS options travel inside one URL string: `redis://[user]:PASSWORD@host:port/db`, `rediss://...` for TLS, with
redis-py's query options (`ssl_ca_certs`, `ssl_cert_reqs`, `ssl_certfile`, `ssl_keyfile`, ...). The password may
instead come from $TANDEM_REDIS_PASSWORD or a file (a Kubernetes Secret), so that it need not sit in a command line
that `ps` shows; `with_credentials` folds it into the URL. Anything printed goes through `redact_url`.
"""

from __future__ import annotations

import os
import ssl
from urllib.parse import SplitResult, parse_qsl, quote, urlencode, urlsplit

import redis

from tandem.errors import InvalidArgument, TandemError

PASSWORD_ENV = "TANDEM_REDIS_PASSWORD"
SCHEMES = ("redis", "rediss", "unix")
_SECRET_QUERY_KEYS = {"password"}  # redis-py takes `?password=` too (the only way for unix:// URLs)


class RedisSetupError(TandemError):
    """Redis answered but refused tandem's credentials or TLS: a configuration error, not an outage to ride out."""


def redact_url(url: str) -> str:
    """The URL without its password (in the userinfo or a `password=` query option), for logs and errors."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable Redis URL>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user, has_password, _ = userinfo.partition(":")
        netloc = f"{user}:***@{host}" if has_password else netloc
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(key in _SECRET_QUERY_KEYS for key, _ in pairs):
            query = urlencode([(key, "***" if key in _SECRET_QUERY_KEYS else value) for key, value in pairs])
    return _join(parts, netloc, query)


def _join(parts: SplitResult, netloc: str, query: str) -> str:
    """urlunsplit, but keeping `unix://` (urlunsplit writes `unix:/path`, which redis-py refuses)."""
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "") + (
        f"#{parts.fragment}" if parts.fragment else "")


def has_password(url: str) -> bool:
    parts = urlsplit(url)
    return bool(parts.password) or any(key in _SECRET_QUERY_KEYS for key, _ in parse_qsl(parts.query))


def read_secret(path: str, field: str) -> str:
    """A password or token file's content without the trailing newline `echo` leaves; InvalidArgument naming
    `field` when it cannot be read or is empty."""
    try:
        with open(path, encoding="utf-8") as handle:
            secret = handle.read().rstrip("\r\n")
    except OSError as exc:
        raise InvalidArgument(f"{field}: cannot read {path} ({exc.strerror or exc})") from None
    if not secret:
        raise InvalidArgument(f"{field}: {path} is empty")
    return secret


def configured_password(password_file: str | None) -> str | None:
    """The Redis password given apart from the URL: --redis-password-file, else $TANDEM_REDIS_PASSWORD."""
    if password_file:
        return read_secret(password_file, "redis_password_file")
    return os.environ.get(PASSWORD_ENV) or None


def with_credentials(url: str, password: str | None = None, ca_file: str | None = None) -> str:
    """`url` with `password` (given apart from it) and a CA bundle for `rediss://` folded in, for redis-py."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise InvalidArgument(f"redis_url: expected redis://host:port/db, rediss:// (TLS) or unix://, got "
                              f"{redact_url(url)!r}")
    query = parse_qsl(parts.query, keep_blank_values=True)
    netloc = parts.netloc
    if password:
        if has_password(url):
            # Two sources that may disagree: refuse rather than pick one silently.
            raise InvalidArgument(f"redis_url: {redact_url(url)} already has a password; give it once (in the URL, "
                                  f"${PASSWORD_ENV} or --redis-password-file)")
        if parts.scheme == "unix":
            query.append(("password", password))
        else:
            user = netloc.rsplit("@", 1)[0] if "@" in netloc else ""
            host = netloc.rsplit("@", 1)[-1]
            netloc = f"{user}:{quote(password, safe='')}@{host}"  # redis-py unquotes it
    if ca_file:
        if parts.scheme != "rediss":
            raise InvalidArgument(f"redis_ca: a CA only applies to TLS; use a rediss:// URL, got "
                                  f"{redact_url(url)!r}")
        if not os.access(ca_file, os.R_OK):
            raise InvalidArgument(f"redis_ca: cannot read {ca_file}")
        query = [(key, value) for key, value in query if key != "ssl_ca_certs"] + [("ssl_ca_certs", ca_file)]
    return _join(parts, netloc, urlencode(query))


def setup_problem(error: redis.RedisError, url: str) -> str | None:
    """What is wrong when `error` means Redis refused our credentials or TLS (None: an outage, e.g. unreachable).
    The message names the fix and the redacted URL, never the password."""
    where = redact_url(url)
    text = str(error)
    if isinstance(error, redis.AuthenticationError) or text.startswith(("NOAUTH", "WRONGPASS")):
        if not has_password(url):
            return (f"Redis at {where} requires a password and none was given: set ${PASSWORD_ENV}, "
                    f"--redis-password-file FILE, or redis://:PASSWORD@host:port/0 ({text})")
        return f"Redis at {where} refused tandem's credentials: check the password and user ({text})"
    if _ssl_failure(error):
        return (f"Redis at {where}: the TLS handshake failed ({text}); a server certificate from a private CA needs "
                "--redis-ca FILE (or ssl_ca_certs=FILE in the URL), a TLS port needs rediss://")
    return None


def _ssl_failure(error: BaseException) -> bool:
    seen: BaseException | None = error
    for _ in range(8):  # the cause chain is short; bounded anyway
        if seen is None:
            return False
        if isinstance(seen, ssl.SSLError) or "SSL" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
