"""Where and how a client connects: target, TLS material, API key and grpc options, shared by both clients."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from tandem.errors import InvalidArgument

try:  # Trace context travels only when OpenTelemetry is installed: an instrumented app has it, a bare client not.
    from tandem.telemetry.propagation import outgoing_metadata
except ImportError:  # pragma: no cover - exercised by the torch-free install check
    def outgoing_metadata() -> list[tuple[str, str]] | None:
        return None

DEFAULT_ADDRESS = "127.0.0.1:50051"  # a gateway's own default (--host, --port)
PemSource = bytes | str | os.PathLike[str]  # PEM bytes, PEM text, or the path of a PEM file


def _pem(source: PemSource | None) -> bytes | None:
    if source is None or isinstance(source, bytes):
        return source
    text = os.fspath(source)
    if text.lstrip().startswith("-----BEGIN"):
        return text.encode()
    with open(text, "rb") as handle:
        return handle.read()


@dataclass(frozen=True, slots=True)
class ChannelSettings:
    """Where and how to connect: shared by the blocking and the asyncio client."""

    target: str
    tls: bool = False
    root_certificates: PemSource | None = None  # None with tls: the system's trust store (grpc's bundled roots)
    private_key: PemSource | None = None  # with certificate_chain: a client certificate (mutual TLS)
    certificate_chain: PemSource | None = None
    api_key: str | None = None  # sent as `authorization: Bearer <key>` on every call
    options: Sequence[tuple[str, Any]] = ()  # grpc channel options, e.g. ("grpc.ssl_target_name_override", host)

    def __post_init__(self) -> None:
        if not self.tls and any(x is not None for x in (self.root_certificates, self.private_key,
                                                        self.certificate_chain)):
            raise InvalidArgument("tls: certificates were given for a plaintext channel; turn TLS on (tls=True, or "
                                  "--tls on the command line)")
        if (self.private_key is None) != (self.certificate_chain is None):
            raise InvalidArgument("private_key: a client certificate needs both private_key and certificate_chain")
        if self.api_key is not None and (not self.api_key or any(c in self.api_key for c in "\r\n")):
            raise InvalidArgument("api_key: must be a non-empty single-line string")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=_pem(self.root_certificates),
                                            private_key=_pem(self.private_key),
                                            certificate_chain=_pem(self.certificate_chain))

    def metadata(self) -> list[tuple[str, str]] | None:
        """Per-call metadata: the API key and the current trace context. The key goes as plain metadata rather than
        grpc call credentials, which grpc sends over TLS only: a gateway behind a TLS-terminating proxy or mesh is
        reached in plaintext and still wants the key."""
        metadata = list(outgoing_metadata() or ())
        if self.api_key is not None:
            metadata.append(("authorization", f"Bearer {self.api_key}"))
        return metadata or None
