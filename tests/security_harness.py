"""What the security tests (tests/test_security_*.py) share: a prompt and greedy options, gRPC health's SERVING, three
tenants' API keys in a keys file, a gateway with TLS, those keys, the HTTP API and sessions in memory, and clients of
it that trust the test CA: TandemClient over gRPC, httpx over HTTP."""

from __future__ import annotations

import ssl
from collections.abc import Iterator

import httpx
import pytest
from grpc_health.v1 import health_pb2

from gateway_harness import ServerThread, tiny_backend
from pki import make_pki
from tandem.client import TandemClient
from tandem.gateway.auth import ApiKeys, create_key
from tandem.sessions import MemorySessionStore

PROMPT = [5, 17, 99, 3, 42, 8]
GREEDY = {"temperature": 0.0, "ignore_eos": True}
SERVING = health_pb2.HealthCheckResponse.SERVING


def make_keys(tmp_path_factory) -> dict:
    """A keys file with alice's, bob's and capped's keys (capped: one request at a time): its path and each key."""
    path = tmp_path_factory.mktemp("keys") / "keys.jsonl"
    made = {"alice": create_key(path, "alice"), "bob": create_key(path, "bob"),
            "capped": create_key(path, "capped", max_concurrency=1)}
    return {"path": str(path), **made}


def tls_server(tiny_models, pki: dict, keys: dict) -> Iterator[ServerThread]:
    """A module fixture's body: TLS (no client certificate asked for), API keys, the HTTP API, sessions in memory."""
    target, draft, _ = tiny_models
    running = ServerThread(tiny_backend(target, draft), sessions=MemorySessionStore(), http_port=0,
                           tls_cert=pki["server_cert_path"], tls_key=pki["server_key_path"],
                           api_keys=ApiKeys.load(keys["path"]))
    yield running
    running.stop()


def _client(server: ServerThread, pki: dict, key: str | None = None, **options) -> TandemClient:
    return TandemClient(server.address, tls=True, root_certificates=pki["ca_path"], api_key=key,
                        timeout=options.pop("timeout", 60), **options)


def _http(pki: dict, key: str | None = None, **options) -> httpx.Client:
    headers = {"authorization": f"Bearer {key}"} if key else None
    return httpx.Client(verify=ssl.create_default_context(cafile=pki["ca_path"]), headers=headers, timeout=60,
                        **options)


# The fixtures every security module takes, one instance a module: a module imports them by these names (pytest finds
# a fixture by the name it is given; the import keeps ruff from reading the test arguments as redefinitions).
@pytest.fixture(scope="module", name="pki")
def pki_fixture(tmp_path_factory) -> dict:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module", name="keys")
def keys_fixture(tmp_path_factory) -> dict:
    return make_keys(tmp_path_factory)


@pytest.fixture(scope="module", name="server")
def server_fixture(tiny_models, pki, keys):
    """TLS (no client certificate asked for), API keys, the HTTP API, sessions in memory."""
    yield from tls_server(tiny_models, pki, keys)
