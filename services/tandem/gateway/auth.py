"""API keys and tenants: who may call the gateway, and whose requests are whose.

The keys file holds one JSON object per line, {"sha256": "<hex of sha256(key)>", "tenant": NAME, "max_concurrency": N
(optional), "priority": P (optional)}; the keys themselves are never stored (`tandem keys create` prints a new one
once). A presented key is hashed and the hash looked up in a dict: what the lookup costs does not depend on how much
of a key matched, so timing tells an attacker nothing about a stored key's text; the found entry's hash is compared
once more with hmac.compare_digest so the check does not rest on dict equality alone.

The tenant a key maps to namespaces request and session ids inside the gateway (tandem.gateway.generation),
max_concurrency caps that tenant's requests in flight, and priority is added to each of its requests' own (a tier:
a free tier's keys run behind a paid one's).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tandem.errors import InvalidArgument

BEARER = "bearer "
# A tenant name becomes an id prefix ("<tenant>:<id>"): no ":" (which would let one tenant's ids spell another's).
TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
KEY_BYTES = 32  # secrets.token_urlsafe(32): 43 characters, 256 bits
MAX_PRIORITY = 2**31 - 1  # a client's priorities are int32s (the gateway's own work runs beyond them)


@dataclass(slots=True, frozen=True)
class Tenant:
    name: str
    max_concurrency: int | None = None  # requests in flight at once; None: no cap beyond the gateway's queue
    priority: int = 0  # added to each of its requests' priority (lower runs first: core.engine)


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def check_tenant_name(name: str) -> str:
    if not TENANT_NAME.match(name):
        raise InvalidArgument(f"tenant: {name!r} is not a valid name (letters, digits, '_', '.', '-'; at most 64; "
                              "starting with a letter or digit)")
    return name


class ApiKeys:
    """The keys a gateway accepts: sha256 hex -> Tenant."""

    def __init__(self, entries: dict[str, Tenant]) -> None:
        self._entries = {digest: (digest, tenant) for digest, tenant in entries.items()}

    @classmethod
    def load(cls, path: str | os.PathLike) -> ApiKeys:
        """Read a keys file; a malformed line is an InvalidArgument naming the file and line."""
        entries = _read_entries(path)
        if not entries:
            raise InvalidArgument(f"api_keys: {path} holds no keys (`tandem keys create` adds one)")
        return cls(entries)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tenants(self) -> dict[str, Tenant]:
        """Tenant name -> Tenant (each of a tenant's keys carries the same cap and priority: load checks)."""
        return {tenant.name: tenant for _, tenant in self._entries.values()}

    def authenticate(self, key: str) -> Tenant | None:
        digest = key_hash(key)
        found = self._entries.get(digest)
        if found is None:
            return None
        stored, tenant = found
        # The dict matched by this very hash; the constant-time comparison keeps the check from resting on it alone.
        return tenant if hmac.compare_digest(stored, digest) else None

    def from_authorization(self, value: str | None) -> Tenant | None:
        """The tenant of an `authorization: Bearer <key>` value; None when absent, malformed or unknown."""
        if not value or value[:len(BEARER)].lower() != BEARER:
            return None
        key = value[len(BEARER):].strip()
        return self.authenticate(key) if key else None

    def from_metadata(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Tenant | None:
        for name, value in metadata or ():
            if name.lower() == "authorization" and isinstance(value, str):
                return self.from_authorization(value)
        return None


def _parse_entry(data: object) -> tuple[str, Tenant]:
    if not isinstance(data, dict):
        raise InvalidArgument("each line must be a JSON object")
    digest = data.get("sha256")
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise InvalidArgument("sha256: must be 64 lowercase hex digits")
    name = data.get("tenant")
    if not isinstance(name, str):
        raise InvalidArgument("tenant: required, a string")
    check_tenant_name(name)
    cap = data.get("max_concurrency")
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
        raise InvalidArgument("max_concurrency: must be a positive integer")
    priority = data.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool) or not 0 <= priority <= MAX_PRIORITY:
        raise InvalidArgument(f"priority: must be an integer from 0 to {MAX_PRIORITY}")
    return digest, Tenant(name, cap, priority)


def _read_entries(path: str | os.PathLike) -> dict[str, Tenant]:
    """A keys file's entries, sha256 hex -> Tenant, each line checked; an InvalidArgument names the file and line."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InvalidArgument(f"api_keys: cannot read {path}: {exc.strerror or exc}") from exc
    entries: dict[str, Tenant] = {}
    tenants: dict[str, Tenant] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            digest, tenant = _parse_entry(json.loads(line))
        except (ValueError, TypeError, InvalidArgument) as exc:
            raise InvalidArgument(f"api_keys: {path} line {number}: {exc}") from exc
        # What a key or a tenant stands for must not rest on the order of lines: one key listed twice, or one
        # tenant's keys giving it two caps or priorities, is refused.
        if digest in entries:
            raise InvalidArgument(f"api_keys: {path} line {number}: this key is already listed, for tenant "
                                  f"{entries[digest].name!r}")
        if (known := tenants.setdefault(tenant.name, tenant)) != tenant:
            raise InvalidArgument(f"api_keys: {path} line {number}: tenant {tenant.name!r} is listed before with "
                                  f"{_settings(known)}; give each of its keys the same")
        entries[digest] = tenant
    return entries


def _settings(tenant: Tenant) -> str:
    return f"max_concurrency {tenant.max_concurrency} and priority {tenant.priority}"


def create_key(path: str | os.PathLike, tenant: str, max_concurrency: int | None = None, priority: int = 0) -> str:
    """Append a new key's hash for `tenant` to the keys file (created 0600 if missing) and return the key."""
    check_tenant_name(tenant)
    if max_concurrency is not None and max_concurrency < 1:
        raise InvalidArgument(f"max_concurrency: must be at least 1, got {max_concurrency}")
    if not 0 <= priority <= MAX_PRIORITY:
        raise InvalidArgument(f"priority: must be from 0 to {MAX_PRIORITY}, got {priority}")
    if os.path.exists(path):  # a tenant's new key (a rotation) carries the cap and priority its others carry
        known = next((entry for entry in _read_entries(path).values() if entry.name == tenant), None)
        if known is not None and known != Tenant(tenant, max_concurrency, priority):
            raise InvalidArgument(f"tenant: {tenant!r} has keys in {path} with {_settings(known)}; a new key for it "
                                  "must carry the same (edit the file to change them)")
    key = "tk-" + secrets.token_urlsafe(KEY_BYTES)
    entry: dict = {"sha256": key_hash(key), "tenant": tenant}
    if max_concurrency is not None:
        entry["max_concurrency"] = max_concurrency
    if priority:
        entry["priority"] = priority
    try:
        # O_APPEND: concurrent creations never overwrite each other's lines; 0600: hashes are not secrets, but the
        # file says which tenants exist.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a") as out:
            out.write(json.dumps(entry) + "\n")
    except OSError as exc:
        raise InvalidArgument(f"file: cannot write {path}: {exc.strerror or exc}") from exc
    return key
