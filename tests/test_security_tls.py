"""TLS against real gateways on tiny models, with certificates made here: gRPC (TandemClient) and HTTP (httpx, the
openai SDK) handshakes, mutual TLS, the options' and files' refusals, the load tester over TLS, and `tandem serve`
with TLS and API keys."""

from __future__ import annotations

import asyncio
import os
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from gateway_harness import ServerThread, tiny_backend
from loadtest.backend_base import RequestSpec
from loadtest.backends import GrpcBackend
from loadtest.config import RunConfig
from loadtest.openai_backend import OpenAIBackend
from loadtest.prompts import Prompt
from security_harness import (  # the fixtures by their names: keys, pki, server
    GREEDY,
    PROMPT,
    SERVING,
    _client,
    _http,
    keys_fixture,  # noqa: F401
    pki_fixture,  # noqa: F401
    server_fixture,  # noqa: F401
)
from tandem.client import TandemClient
from tandem.errors import InvalidArgument

SERVICES = Path(__file__).resolve().parent.parent / "services"


def test_grpc_over_tls(server, pki, keys) -> None:
    with _client(server, pki, keys["alice"]) as client:
        result = client.generate_result(token_ids=PROMPT, max_tokens=8, **GREEDY)
        assert len(result.token_ids) == 8 and client.model_info().target_model == "tiny-target"
    # Plaintext to the TLS port, or a client trusting another CA: no handshake, no answer.
    for client in (TandemClient(server.address, api_key=keys["alice"], timeout=3),
                   TandemClient(server.address, tls=True, root_certificates=pki["other_ca"], api_key=keys["alice"],
                                timeout=3)):
        with client, pytest.raises(grpc.RpcError) as failed:
            client.health_status()
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE


def test_http_over_tls(server, pki, keys) -> None:
    url = server.gateway.http_url
    assert url.startswith("https://127.0.0.1:")
    with _http(pki) as client:
        health = client.get(f"{url}/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key=keys["alice"], max_retries=0,
                        http_client=_http(pki))
    response = sdk.completions.create(model="tiny-target", prompt=PROMPT, max_tokens=6, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 6
    with pytest.raises(httpx.TransportError):
        httpx.get(url.replace("https://", "http://") + "/health", timeout=5)
    with pytest.raises(httpx.ConnectError):  # the system trust store does not know the test CA
        httpx.get(f"{url}/health", timeout=5)


def test_mutual_tls(tiny_models, pki) -> None:
    target, draft, _ = tiny_models
    running = ServerThread(tiny_backend(target, draft), http_port=0, tls_cert=pki["server_cert_path"],
                           tls_key=pki["server_key_path"], tls_client_ca=pki["ca_path"])
    try:
        key, chain = pki["client"]
        with _client(running, pki, private_key=key, certificate_chain=chain) as client:
            assert len(client.generate_result(token_ids=PROMPT, max_tokens=4, **GREEDY).token_ids) == 4
        with _client(running, pki, timeout=3) as client, pytest.raises(grpc.RpcError) as failed:
            client.health_status()
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE

        url = running.gateway.http_url
        with_cert = ssl.create_default_context(cafile=pki["ca_path"])
        with_cert.load_cert_chain(pki["client_cert_path"], pki["client_key_path"])
        assert httpx.get(f"{url}/health", verify=with_cert, timeout=10).status_code == 200
        with pytest.raises(httpx.TransportError):  # TLS 1.3: the refusal may surface on the first read
            httpx.get(f"{url}/health", verify=ssl.create_default_context(cafile=pki["ca_path"]), timeout=5)

        # The load tester with a client certificate (it had none to give: no load test of such a gateway).
        mutual = {"ca": pki["ca_path"], "client_cert": pki["client_cert_path"], "client_key": pki["client_key_path"]}
        for config, backend_type in ((RunConfig(address=running.address, requests=1, tls=True, **mutual), GrpcBackend),
                                     (RunConfig(address="", requests=1, backend="openai", url=url,
                                                openai_token_counts="chunks", **mutual), OpenAIBackend)):
            info, events = asyncio.run(_one_request(config, backend_type))
            assert info["target_model"] == "tiny-target" and events[-1].finish_reason == "FINISH_REASON_LENGTH"
        with pytest.raises(ValueError, match="both --client-cert and --client-key"):
            RunConfig(address=running.address, requests=1, tls=True, client_cert=pki["client_cert_path"])
    finally:
        running.stop()


async def _one_request(config: RunConfig, backend_type) -> tuple[dict, list]:
    """One 4-token request through a load-tester backend: (what open() says, the request's events)."""
    spec = RequestSpec(Prompt("p", "code", "short", text="def add(a, b):"), "lt-1", "", 4, 0.0, None, True, "auto",
                       None)
    async with backend_type(config) as backend:
        info = await backend.open()
        return info, [event async for event in backend.stream(spec)]


def test_tls_options_are_both_or_neither(pki) -> None:
    from tandem.gateway.options import GatewayOptions

    with pytest.raises(InvalidArgument, match="tls"):
        GatewayOptions(tls_cert=pki["server_cert_path"])
    with pytest.raises(InvalidArgument, match="tls_client_ca"):
        GatewayOptions(tls_client_ca=pki["ca_path"])


def test_bad_tls_files_are_named(tiny_models, pki, tmp_path) -> None:
    from tandem.gateway.options import GatewayOptions
    from tandem.gateway.run import start_gateway

    target, draft, _ = tiny_models
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    cases = [({"tls_cert": str(garbage), "tls_key": pki["server_key_path"]}, "tls_cert"),
             ({"tls_cert": pki["server_cert_path"], "tls_key": pki["client_key_path"]}, "tls_cert"),  # another's key
             ({"tls_cert": pki["server_cert_path"], "tls_key": str(tmp_path / "missing.key")}, "tls_key"),
             ({"tls_cert": pki["server_cert_path"], "tls_key": pki["server_key_path"],
               "tls_client_ca": str(garbage)}, "tls_client_ca")]
    for files, field in cases:
        with pytest.raises(InvalidArgument, match=field):
            asyncio.run(start_gateway(tiny_backend(target, draft), GatewayOptions(port=0, **files)))


# --- the load tester over TLS -------------------------------------------------------------------------------------


def test_loadtest_backends_over_tls(server, pki, keys) -> None:
    grpc_config = RunConfig(address=server.address, requests=1, tls=True, ca=pki["ca_path"], api_key=keys["alice"])
    http_config = RunConfig(address="", requests=1, backend="openai", url=server.gateway.http_url, ca=pki["ca_path"],
                            api_key=keys["alice"], openai_token_counts="chunks")
    assert grpc_config.to_json()["api_key"] == "<set>"
    info, events = asyncio.run(_one_request(grpc_config, GrpcBackend))
    assert info["target_model"] == "tiny-target" and events[-1].completion_tokens == 4
    info, events = asyncio.run(_one_request(http_config, OpenAIBackend))
    assert info["target_model"] == "tiny-target" and events[-1].finish_reason == "FINISH_REASON_LENGTH"
    with pytest.raises(ValueError, match="https"):
        RunConfig(address="", requests=1, backend="openai", url="http://127.0.0.1:1", ca=pki["ca_path"])


# --- `tandem serve` with the flags --------------------------------------------------------------------------------


def test_tandem_serve_with_tls_and_keys(tiny_dirs, pki, keys) -> None:
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(SERVICES), os.environ.get("PYTHONPATH")])),
                        "REDIS_URL": ""}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem", "serve", "--in-process", "--target", str(tiny_dirs.target), "--draft",
         str(tiny_dirs.draft), "--port", "0", "--http-port", "0", "--no-metrics", "--dtype", "float32",
         "--threads", "1", "--kv-tokens", "4096", "--grace", "5", "--tls-cert", pki["server_cert_path"],
         "--tls-key", pki["server_key_path"], "--api-keys", keys["path"]],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines: dict[str, str] = {}
        for line in proc.stdout:
            for marker in ("GenerationService on ", "HTTP API on "):
                if marker in line:
                    lines[marker] = line
            if len(lines) == 2:
                break
        assert len(lines) == 2, proc.stderr.read() if proc.poll() is not None else lines
        assert "(TLS, 3 API keys;" in lines["GenerationService on "]
        address = lines["GenerationService on "].split(" on ")[1].split()[0]
        url = lines["HTTP API on "].split(" on ")[1].split()[0].removesuffix("/v1")
        assert url.startswith("https://")
        with TandemClient(address, tls=True, root_certificates=pki["ca_path"], api_key=keys["bob"],
                          timeout=60) as client:
            deadline = time.monotonic() + 120  # loading happens after the ports are bound
            while client.health_status("tandem.v1.GenerationService") != SERVING:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
                time.sleep(0.25)
            ready = proc.stdout.readline()  # the line after the addresses says when it turned ready
            assert ready.startswith(f"tandem: ready: {tiny_dirs.target} loaded, readiness SERVING ("), ready
            assert len(client.generate_result(token_ids=PROMPT, max_tokens=3, **GREEDY).token_ids) == 3
        with _http(pki, keys["bob"]) as client:
            assert client.get(f"{url}/v1/models").status_code == 200
        with _http(pki) as client:
            assert client.get(f"{url}/v1/models").status_code == 401
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
