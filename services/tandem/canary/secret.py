"""The server secret that keys canary assignment (HMAC-SHA256, see assignment.py).

A session's arm must not be computable by clients, or a client could pick session ids that land on the candidate and
steer the analysis with its own traffic. So the point a session is placed at is an HMAC keyed with this secret. Every
gateway replica of a deployment must hold the same secret (else replicas place a session on different arms); it comes
from, in order:

    --canary-secret-file PATH  (or $TANDEM_CANARY_SECRET_FILE)  the file's bytes, surrounding whitespace stripped
    $TANDEM_CANARY_SECRET                                       the variable's text (a Kubernetes secretKeyRef)

With neither, each process draws a random secret once and logs a warning: a single gateway works, but replicas (and
one gateway across restarts) disagree on a session's arm. The secret is never logged, printed or put in a repr; only
where it came from (`source`) is.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tandem.errors import InvalidArgument

log = logging.getLogger(__name__)

ENV_SECRET = "TANDEM_CANARY_SECRET"
ENV_SECRET_FILE = "TANDEM_CANARY_SECRET_FILE"
MIN_SECRET_BYTES = 16  # 128 bits: `openssl rand -hex 32` gives 64 characters
MAX_SECRET_BYTES = 4096  # a larger "secret file" is most likely the wrong file
RANDOM_SECRET_BYTES = 32


@dataclass(slots=True, frozen=True)
class CanarySecret:
    key: bytes = field(repr=False)  # never in a repr, a log line or an error message
    source: str  # where it came from (safe to log): "file PATH", "$TANDEM_CANARY_SECRET", "random (this process)"
    shared: bool = True  # False for the per-process random secret

    def __post_init__(self) -> None:
        if not isinstance(self.key, bytes) or len(self.key) < MIN_SECRET_BYTES:
            raise InvalidArgument(f"canary_secret: {self.source} must hold at least {MIN_SECRET_BYTES} bytes "
                                  "(e.g. `openssl rand -hex 32`)")


def secret_from_file(path: str | os.PathLike) -> CanarySecret:
    """The secret in `path` (whitespace around it stripped, so `openssl rand -hex 32 > FILE` works)."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_SECRET_BYTES + 1)
    except OSError as exc:
        raise InvalidArgument(f"canary_secret_file: cannot read {path}: {exc.strerror}") from None
    if len(data) > MAX_SECRET_BYTES:
        raise InvalidArgument(f"canary_secret_file: {path} is larger than {MAX_SECRET_BYTES} bytes; is it the "
                              "secret?")
    return CanarySecret(data.strip(), f"file {Path(path)}")


def configured_secret(path: str | os.PathLike | None = None,
                      environ: Mapping[str, str] | None = None) -> CanarySecret | None:
    """The configured shared secret: `path` (the flag), else $TANDEM_CANARY_SECRET_FILE, else $TANDEM_CANARY_SECRET;
    None when none is set (the controller then uses random_secret())."""
    env = os.environ if environ is None else environ
    path = path or env.get(ENV_SECRET_FILE) or None
    if path is not None:
        return secret_from_file(path)
    if text := env.get(ENV_SECRET, "").strip():
        return CanarySecret(text.encode(), f"${ENV_SECRET}")
    return None


_random: CanarySecret | None = None
_random_lock = threading.Lock()


def random_secret() -> CanarySecret:
    """This process's random secret, drawn once (so every controller in the process agrees), with one warning."""
    global _random
    with _random_lock:
        if _random is None:
            _random = CanarySecret(secrets.token_bytes(RANDOM_SECRET_BYTES), "random (this process)", shared=False)
            log.warning("canary: no shared assignment secret configured (--canary-secret-file or $%s): using a "
                        "random one for this process, so gateway replicas place a session on different arms and "
                        "sessions change arms when this gateway restarts", ENV_SECRET)
        return _random
