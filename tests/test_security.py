"""TLS, API keys and tenants against real gateways on tiny models: handshakes with certificates made here (gRPC via
TandemClient, HTTP via httpx and the openai SDK), keys checked on every method but health, tenants' request and
session ids kept apart, per-tenant concurrency caps, the CLI's refusals, and the load tester over TLS."""

from __future__ import annotations

import asyncio
import json
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
import yaml
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from gateway_harness import ServerThread, tiny_backend
from loadtest.backend_base import RequestSpec
from loadtest.backends import GrpcBackend
from loadtest.config import RunConfig
from loadtest.openai_backend import OpenAIBackend
from loadtest.prompts import Prompt
from pki import make_pki
from tandem.cli.main import build_parser, main
from tandem.cli.serving import gateway_options
from tandem.client import TandemClient
from tandem.errors import InvalidArgument
from tandem.gateway.auth import ApiKeys, create_key
from tandem.gateway.options import GatewayOptions
from tandem.sessions import MemorySessionStore
from tandem.v1 import generation_pb2 as pb

SERVICES = Path(__file__).resolve().parent.parent / "services"
PROMPT = [5, 17, 99, 3, 42, 8]
GREEDY = {"temperature": 0.0, "ignore_eos": True}
LONG = 4000  # max_tokens of a request that is still running when the test acts on it
SERVING = health_pb2.HealthCheckResponse.SERVING
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("keys") / "keys.jsonl"
    made = {"alice": create_key(path, "alice"), "bob": create_key(path, "bob"),
            "capped": create_key(path, "capped", max_concurrency=1)}
    return {"path": str(path), **made}


@pytest.fixture(scope="module")
def server(tiny_models, pki, keys):
    """TLS (no client certificate asked for), API keys, the HTTP API, sessions in memory."""
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


# --- TLS ----------------------------------------------------------------------------------------------------------


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


# --- API keys -----------------------------------------------------------------------------------------------------


def test_grpc_methods_need_a_key_health_does_not(server, pki, keys) -> None:
    for key in (None, "tk-wrong"):
        with _client(server, pki, key, timeout=10) as client:
            assert client.health_status("tandem.v1.GenerationService") == SERVING  # health needs no key
            for call in (lambda: list(client.generate(token_ids=PROMPT, max_tokens=2)), lambda: client.tokenize("hi"),
                         client.model_info, lambda: client.abort("r")):
                with pytest.raises(grpc.RpcError) as failed:
                    call()
                assert failed.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "API key" in failed.value.details()
    with _client(server, pki, keys["bob"]) as client:
        assert client.tokenize("hi") and client.abort("r") is False


def _reflection(server: ServerThread, pki: dict, key: str | None) -> list[str]:
    credentials = grpc.ssl_channel_credentials(pki["ca"])
    with grpc.secure_channel(server.address, credentials) as channel:
        call = channel.stream_stream(REFLECTION,
                                     request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                     response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        metadata = [("authorization", f"Bearer {key}")] if key else None
        responses = call(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), metadata=metadata,
                         timeout=10)
        return [s.name for r in responses for s in r.list_services_response.service]


def test_reflection_needs_a_key(server, pki, keys) -> None:
    assert "tandem.v1.GenerationService" in _reflection(server, pki, keys["alice"])
    with pytest.raises(grpc.RpcError) as failed:
        _reflection(server, pki, None)
    assert failed.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_http_needs_a_key(server, pki, keys) -> None:
    url = server.gateway.http_url
    body = {"model": "tiny-target", "prompt": "hi", "max_tokens": 2}
    for key in (None, "tk-wrong"):
        with _http(pki, key) as client:
            for response in (client.get(f"{url}/v1/models"), client.post(f"{url}/v1/completions", json=body),
                             client.post(f"{url}/v1/chat/completions", content=b"not json"),
                             client.post(f"{url}/v1/responses", json={"input": "hi"}),
                             client.get(f"{url}/v1/responses/resp_x"), client.delete(f"{url}/v1/responses/resp_x"),
                             client.get(f"{url}/v1/models/tiny-target"),
                             client.post(f"{url}/tokenize", json={"prompt": "hi"}),
                             client.get(f"{url}/tokenizer_info")):
                assert response.status_code == 401, response.text
                error = response.json()["error"]
                assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
            assert client.get(f"{url}/health").status_code == 200
    with _http(pki, keys["alice"]) as client:
        assert client.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny-target"
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="tk-wrong", max_retries=0, http_client=_http(pki))
    with pytest.raises(openai.AuthenticationError):
        sdk.models.list()


def test_browser_pages_of_allowed_origins_alone_may_call_the_http_api(tiny_models, keys) -> None:
    """CORS: off by default (a page's script cannot read the API's answers, nor pass a preflight); with
    --allowed-origins, a listed origin's preflight is answered (no key needed for it) and every answer, a 401 too,
    names that origin; another origin gets no such header. Keys still apply."""
    target, draft, _ = tiny_models
    body = {"model": "tiny-target", "prompt": "hi", "max_tokens": 2}
    app, other = "https://app.example.com", "https://evil.example.com"
    preflight = {"access-control-request-method": "POST", "access-control-request-headers": "authorization"}
    for allowed in ((), (app,)):
        running = ServerThread(tiny_backend(target, draft), sessions=MemorySessionStore(), http_port=0,
                               api_keys=ApiKeys.load(keys["path"]), allowed_origins=allowed)
        try:
            url = running.gateway.http_url
            with httpx.Client(timeout=60) as client:
                asked = client.options(f"{url}/v1/completions", headers={"origin": app} | preflight)
                answered = client.post(f"{url}/v1/completions", json=body,
                                       headers={"origin": app, "authorization": f"Bearer {keys['alice']}"})
                refused = client.get(f"{url}/v1/models", headers={"origin": app})
                stranger = client.options(f"{url}/v1/completions", headers={"origin": other} | preflight)
            assert answered.status_code == 200 and refused.status_code == 401
            assert "access-control-allow-origin" not in stranger.headers
            if not allowed:
                assert asked.status_code == 405 and "access-control-allow-origin" not in answered.headers
                continue
            assert asked.status_code == 200 and asked.headers["access-control-allow-origin"] == app
            assert "authorization" in asked.headers["access-control-allow-headers"].lower()
            assert answered.headers["access-control-allow-origin"] == app
            assert refused.headers["access-control-allow-origin"] == app  # the page can read why
        finally:
            running.stop()
    with pytest.raises(InvalidArgument, match="allowed_origins"):
        GatewayOptions(allowed_origins=("app.example.com/path",))


def test_keys_file_and_cli(tmp_path, capsys) -> None:
    path = tmp_path / "keys.jsonl"
    assert main(["keys", "create", "--tenant", "team-1", "--file", str(path), "--max-concurrency", "3",
                 "--priority", "7"]) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith("tk-") and key not in path.read_text()  # only the hash is stored
    assert (path.stat().st_mode & 0o777) == 0o600
    assert json.loads(path.read_text())["tenant"] == "team-1"
    keys = ApiKeys.load(path)
    tenant = keys.from_authorization(f"Bearer {key}")
    assert tenant is not None and (tenant.name, tenant.max_concurrency, tenant.priority) == ("team-1", 3, 7)
    assert keys.from_authorization(f"Basic {key}") is None and keys.authenticate(key + "x") is None
    assert main(["keys", "create", "--tenant", "a:b", "--file", str(path)]) == 2  # ':' would blur the namespaces
    path.write_text("{not json\n")
    with pytest.raises(InvalidArgument, match="line 1"):
        ApiKeys.load(path)


def test_serve_refuses_an_open_host_without_keys(tmp_path) -> None:
    parser = build_parser()
    keys = tmp_path / "keys.jsonl"
    create_key(keys, "t")
    with pytest.raises(InvalidArgument, match="--insecure"):
        gateway_options(parser.parse_args(["serve", "--host", "0.0.0.0"]))
    with pytest.raises(InvalidArgument, match="--insecure"):
        gateway_options(parser.parse_args(["gateway", "--pools", "p", "--host", "10.1.2.3"]))
    assert gateway_options(parser.parse_args(["serve", "--host", "0.0.0.0", "--insecure"])).api_keys is None
    options = gateway_options(parser.parse_args(["serve", "--host", "0.0.0.0", "--api-keys", str(keys)]))
    assert len(options.api_keys) == 1
    for host in ("127.0.0.1", "::1", "localhost"):
        assert gateway_options(parser.parse_args(["serve", "--host", host])).host == host
    with pytest.raises(InvalidArgument, match="tls"):
        gateway_options(parser.parse_args(["serve", "--tls-key", "k.pem"]))
    # Any web origin without keys: any page its user opens could read what the server stores.
    with pytest.raises(InvalidArgument, match="allowed_origins: \\* without --api-keys"):
        gateway_options(parser.parse_args(["serve", "--allowed-origins", "*"]))
    for flags in (["--allowed-origins", "*", "--insecure"], ["--allowed-origins", "*", "--api-keys", str(keys)],
                  ["--allowed-origins", "https://a.example.com, http://localhost:3000"]):
        assert gateway_options(parser.parse_args(["serve", *flags])).allowed_origins


# --- tenants ------------------------------------------------------------------------------------------------------


def test_a_tenant_cannot_abort_another_tenants_request(server, pki, keys) -> None:
    with _client(server, pki, keys["alice"]) as alice, _client(server, pki, keys["bob"]) as bob:
        stream = alice.generate(token_ids=PROMPT, request_id="shared", max_tokens=200, **GREEDY)
        assert isinstance(next(stream), pb.Chunk)
        assert bob.abort("shared") is False
        # The same id in bob's namespace is another request: it runs alongside alice's.
        assert bob.generate_result(token_ids=PROMPT, request_id="shared", max_tokens=4, **GREEDY).request_id == "shared"
        complete = next(item for item in stream if isinstance(item, pb.Complete))
        assert complete.finish_reason == pb.FINISH_REASON_LENGTH and complete.request_id == "shared"
        stream = alice.generate(token_ids=PROMPT, request_id="mine", max_tokens=LONG, **GREEDY)
        assert isinstance(next(stream), pb.Chunk)
        assert alice.abort("mine") is True  # its own: found
        complete = next(item for item in stream if isinstance(item, pb.Complete))
        assert complete.finish_reason == pb.FINISH_REASON_ABORT and complete.request_id == "mine"
    assert server.wait_for(lambda: server.gateway.loop.active == 0)


def test_same_session_id_in_two_tenants_is_two_sessions(server, pki, keys) -> None:
    runner = server.engine.verifier.runner
    store = server.gateway.loop.sessions
    with _client(server, pki, keys["alice"]) as alice, _client(server, pki, keys["bob"]) as bob:
        alice.generate_result(token_ids=PROMPT, session_id="s1", max_tokens=8, **GREEDY)
        assert server.wait_for(lambda: "alice:s1" in runner.retained and store.get("alice:s1") is not None)
        reused = runner.reused_tokens
        bob.generate_result(token_ids=PROMPT, session_id="s1", max_tokens=8, **GREEDY)
        assert runner.reused_tokens == reused  # alice's cache is not bob's
        assert server.wait_for(lambda: "bob:s1" in runner.retained and store.get("bob:s1") is not None)
        assert "s1" not in runner.retained and store.get("s1") is None
        alice.generate_result(token_ids=PROMPT, session_id="s1", max_tokens=8, **GREEDY)
        assert runner.reused_tokens > reused  # alice's own session does reuse its cache


def test_a_tenants_prompt_prefix_serves_its_own_requests_only(server, pki, keys) -> None:
    runner = server.engine.verifier.runner
    system = list(range(200, 240))  # a 40-token system prompt: long enough to share (core.runner)
    with _client(server, pki, keys["alice"]) as alice, _client(server, pki, keys["bob"]) as bob:
        alice.generate_result(token_ids=system + [1, 2], max_tokens=4, **GREEDY)
        assert server.wait_for(lambda: not runner.states)
        shared = runner.shared_tokens
        bob.generate_result(token_ids=system + [3, 4], max_tokens=4, **GREEDY)
        assert runner.shared_tokens == shared  # alice's cached prompt is not bob's to time
        alice.generate_result(token_ids=system + [5, 6], max_tokens=4, **GREEDY)
        assert runner.shared_tokens >= shared + len(system)


def test_a_tenants_stored_responses_are_its_own(server, pki, keys) -> None:
    """Another API key cannot read, list, continue, delete, cancel or stream a stored response, nor read, extend or
    use a conversation, whatever id it sends."""
    url = f"{server.gateway.http_url}/v1/responses"
    with _http(pki, keys["alice"]) as alice, _http(pki, keys["bob"]) as bob, _http(pki) as nobody:
        stored = alice.post(url, json={"model": "tiny-target", "input": "hi", "max_output_tokens": 2, **GREEDY})
        response_id = stored.json()["id"]
        for refused in (bob.get(f"{url}/{response_id}"), bob.get(f"{url}/{response_id}/input_items"),
                        bob.delete(f"{url}/{response_id}"),
                        bob.post(url, json={"model": "tiny-target", "input": "and?", "max_output_tokens": 2,
                                            "previous_response_id": response_id})):
            assert refused.status_code == 404, refused.text
        assert alice.get(f"{url}/{response_id}").json() == stored.json()
        continued = alice.post(url, json={"model": "tiny-target", "input": "and?", "max_output_tokens": 2,
                                          "previous_response_id": response_id, **GREEDY})
        assert continued.status_code == 200 and continued.json()["previous_response_id"] == response_id
        running = alice.post(url, json={"model": "tiny-target", "input": "hi", "max_output_tokens": LONG,
                                        "background": True, **GREEDY}).json()["id"]
        for refused in (bob.post(f"{url}/{running}/cancel"), bob.get(f"{url}/{running}", params={"stream": "true"}),
                        nobody.post(f"{url}/{running}/cancel")):
            assert refused.status_code in (401, 404), refused.text
        assert alice.post(f"{url}/{running}/cancel").json()["status"] == "cancelled"
        conversations = f"{server.gateway.http_url}/v1/conversations"
        conversation = alice.post(conversations, json={"items": [{"role": "user", "content": "hi"}]}).json()["id"]
        for refused in (bob.get(f"{conversations}/{conversation}"), bob.get(f"{conversations}/{conversation}/items"),
                        bob.delete(f"{conversations}/{conversation}"),
                        bob.post(f"{conversations}/{conversation}/items", json={"items": [{"role": "user",
                                                                                             "content": "x"}]}),
                        bob.post(url, json={"model": "tiny-target", "input": "and?", "max_output_tokens": 2,
                                            "conversation": conversation}),
                        nobody.get(f"{conversations}/{conversation}")):
            assert refused.status_code in (401, 404), refused.text
        assert len(alice.get(f"{conversations}/{conversation}/items").json()["data"]) == 1


def test_a_tenants_files_and_batches_are_its_own(server, pki, keys) -> None:
    """Another API key cannot read, list, delete or batch a tenant's file, nor read, list or cancel its batch; the
    batch's requests run with its creator's key."""
    base = server.gateway.http_url
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny-target", "prompt": "hi", "max_tokens": 2, **GREEDY}}
    with _http(pki, keys["alice"]) as alice, _http(pki, keys["bob"]) as bob, _http(pki) as nobody:
        uploaded = alice.post(f"{base}/v1/files", data={"purpose": "batch"},
                              files={"file": ("in.jsonl", json.dumps(line).encode())}).json()
        batch = {"input_file_id": uploaded["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
        created = alice.post(f"{base}/v1/batches", json=batch).json()
        file = f"{base}/v1/files/{uploaded['id']}"
        for refused in (bob.get(file), bob.get(f"{file}/content"), bob.delete(file),
                        bob.post(f"{base}/v1/batches", json=batch),
                        bob.get(f"{base}/v1/batches/{created['id']}"),
                        bob.post(f"{base}/v1/batches/{created['id']}/cancel"), nobody.get(f"{base}/v1/files"),
                        nobody.get(f"{base}/v1/batches/{created['id']}")):
            assert refused.status_code in (401, 404), refused.text
        assert bob.get(f"{base}/v1/files").json()["data"] == bob.get(f"{base}/v1/batches").json()["data"] == []
        deadline = time.monotonic() + 60
        while (done := alice.get(f"{base}/v1/batches/{created['id']}").json())["status"] != "completed":
            assert time.monotonic() < deadline, done
            time.sleep(0.05)
        assert done["request_counts"] == {"total": 1, "completed": 1, "failed": 0}  # run with alice's key


def test_per_tenant_concurrency_cap(server, pki, keys) -> None:
    url = server.gateway.http_url
    with _client(server, pki, keys["capped"]) as capped, _client(server, pki, keys["alice"]) as alice:
        stream = capped.generate(token_ids=PROMPT, request_id="first", max_tokens=LONG, **GREEDY)
        assert isinstance(next(stream), pb.Chunk)
        with pytest.raises(grpc.RpcError) as failed:
            capped.generate_result(token_ids=PROMPT, max_tokens=2, **GREEDY)
        assert failed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "capped" in failed.value.details()
        with _http(pki, keys["capped"]) as client:
            response = client.post(f"{url}/v1/completions",
                                   json={"model": "tiny-target", "prompt": PROMPT, "max_tokens": 2})
        assert response.status_code == 429 and response.json()["error"]["code"] == "tenant_concurrency"
        assert len(alice.generate_result(token_ids=PROMPT, max_tokens=2, **GREEDY).token_ids) == 2  # others unaffected
        assert capped.abort("first") is True
        list(stream)
        assert server.wait_for(lambda: not server.gateway.generations._tenant_active)
        assert len(capped.generate_result(token_ids=PROMPT, max_tokens=2, **GREEDY).token_ids) == 2


def test_one_tenant_cannot_fill_the_queue(tiny_models, pki, keys) -> None:
    """A queue of 4 and a share of 0.5: alice holds at most 2 places, and bob still gets his."""
    target, draft, _ = tiny_models
    small = ServerThread(tiny_backend(target, draft), sessions=MemorySessionStore(), max_requests=4,
                         tenant_queue_share=0.5, tls_cert=pki["server_cert_path"], tls_key=pki["server_key_path"],
                         api_keys=ApiKeys.load(keys["path"]), http_port=0)
    try:
        with _client(small, pki, keys["alice"]) as alice, _client(small, pki, keys["bob"]) as bob:
            streams = [alice.generate(token_ids=PROMPT, request_id=f"a{i}", max_tokens=LONG, **GREEDY)
                       for i in range(2)]
            for stream in streams:
                assert isinstance(next(stream), pb.Chunk)
            with pytest.raises(grpc.RpcError) as failed:
                alice.generate_result(token_ids=PROMPT, max_tokens=2, **GREEDY)
            assert failed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "alice" in failed.value.details() and "its share is 2" in failed.value.details()
            # A request's n choices each take a place in the queue: n=3 could never fit alice's share of 2, and the
            # queue's places, not its requests, are what the share holds (one request of n=4 filled a queue of 4).
            with pytest.raises(grpc.RpcError) as failed:
                bob.generate_result(token_ids=PROMPT, max_tokens=2, n=3, **GREEDY)
            assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT and failed.value.details().startswith("n:")
            # bob's share is his own: both his requests run beside alice's two.
            bobs = [bob.generate(token_ids=PROMPT, request_id=f"b{i}", max_tokens=LONG, **GREEDY) for i in range(2)]
            for stream in bobs:
                assert isinstance(next(stream), pb.Chunk)
            for i, stream in enumerate([*streams, *bobs]):
                assert (alice if i < 2 else bob).abort(f"{'ab'[i // 2]}{i % 2}") is True
                list(stream)
            assert small.wait_for(lambda: small.gateway.loop.active == 0)
            assert len(alice.generate_result(token_ids=PROMPT, max_tokens=2, **GREEDY).token_ids) == 2
            both = alice.generate(token_ids=PROMPT, request_id="a2", max_tokens=LONG, n=2, **GREEDY)
            assert isinstance(next(both), pb.Chunk)
            with pytest.raises(grpc.RpcError) as failed:  # one request, but its two choices hold alice's share
                alice.generate_result(token_ids=PROMPT, max_tokens=2, **GREEDY)
            assert "holds 2 places of the queue and asks for 1 more" in failed.value.details()
            assert alice.abort("a2") is True
            list(both)
            # Over HTTP a body's prompts each run as a request: three could never fit alice's share of 2, nor two
            # prompts the capped key's one request at a time: 400s naming prompt, never a 429 retried in vain.
            assert small.wait_for(lambda: small.gateway.loop.active == 0)
            url, body = small.gateway.http_url, {"model": "tiny-target", "max_tokens": 2}
            for key, prompts, why in ((keys["alice"], 3, "queue holds for a caller (2"),
                                      (keys["capped"], 2, "max_concurrency (1)")):
                with _http(pki, key) as client:
                    refused = client.post(f"{url}/v1/completions", json=body | {"prompt": [PROMPT] * prompts})
                    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt", refused.text
                    assert why in refused.json()["error"]["message"]
                    fits = client.post(f"{url}/v1/completions", json=body | {"prompt": [PROMPT] * (prompts - 1)})
                    assert fits.status_code == 200, fits.text
    finally:
        small.stop()


def test_tenant_queue_share_is_checked() -> None:
    with pytest.raises(InvalidArgument, match="tenant_queue_share"):
        gateway_options(build_parser().parse_args(["serve", "--tenant-queue-share", "0"]))


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


# --- the Helm chart -----------------------------------------------------------------------------------------------


def test_helm_chart_mounts_the_keys_or_says_insecure() -> None:
    from helm_harness import CHART, helm

    def gateway(*sets: str) -> dict:
        args = [item for value in sets for item in ("--set", value)]
        rendered = helm("template", "demo", str(CHART), *args)
        assert rendered.returncode == 0, rendered.stderr
        return next(doc for doc in yaml.safe_load_all(rendered.stdout)
                    if doc and doc["kind"] == "Deployment" and doc["metadata"]["name"] == "demo-tandem-gateway")

    for topology in ("pools", "embedded"):
        spec = gateway(f"topology={topology}")["spec"]["template"]["spec"]
        assert "--insecure" in spec["containers"][0]["args"]
        assert not any(volume["name"] == "api-keys" for volume in spec["volumes"])
        spec = gateway(f"topology={topology}", "gateway.apiKeys.secretName=tandem-keys")["spec"]["template"]["spec"]
        container = spec["containers"][0]
        assert "--insecure" not in container["args"]
        assert "--api-keys=/etc/tandem/api-keys/keys.jsonl" in container["args"]
        assert {"name": "api-keys", "mountPath": "/etc/tandem/api-keys", "readOnly": True} in container["volumeMounts"]
        volume = next(volume for volume in spec["volumes"] if volume["name"] == "api-keys")
        assert volume["secret"]["secretName"] == "tandem-keys"


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
