"""API keys against real gateways on tiny models: every gRPC method (reflection too) and HTTP route but health needs
one, browser origins (CORS) allowed by name, the keys file and `tandem keys`, the CLI's refusal of an open host
without keys, and the Helm chart mounting the keys or saying --insecure."""

from __future__ import annotations

import json

import grpc
import httpx
import openai
import pytest
import yaml
from grpc_reflection.v1alpha import reflection_pb2

from gateway_harness import ServerThread, tiny_backend
from security_harness import (  # the fixtures by their names: keys, pki, server
    PROMPT,
    SERVING,
    _client,
    _http,
    keys_fixture,  # noqa: F401
    pki_fixture,  # noqa: F401
    server_fixture,  # noqa: F401
)
from tandem.cli.main import build_parser, main
from tandem.cli.serving import gateway_options
from tandem.errors import InvalidArgument
from tandem.gateway.auth import ApiKeys, create_key
from tandem.gateway.options import GatewayOptions
from tandem.sessions import MemorySessionStore

REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"


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


def test_a_key_or_tenant_meaning_two_things_is_refused_at_load_and_at_create(tmp_path, capsys) -> None:
    path = tmp_path / "keys.jsonl"
    for _ in range(2):  # a tenant's second key (a rotation), with its terms
        assert main(["keys", "create", "--tenant", "team-1", "--file", str(path), "--max-concurrency", "3"]) == 0
    capsys.readouterr()
    assert main(["keys", "create", "--tenant", "team-1", "--file", str(path)]) == 2  # no cap: another tenant's terms
    assert "max_concurrency 3 and priority 0" in capsys.readouterr().err
    assert len(path.read_text().splitlines()) == 2 and len(ApiKeys.load(path)) == 2
    first, _ = path.read_text().splitlines()
    renamed = json.dumps({**json.loads(first), "tenant": "team-2"})
    (tmp_path / "twice.jsonl").write_text(f"{first}\n{renamed}\n")  # one key for two tenants: order would decide
    with pytest.raises(InvalidArgument, match="line 2: this key is already listed, for tenant 'team-1'"):
        ApiKeys.load(tmp_path / "twice.jsonl")
    other = json.dumps({"sha256": "0" * 64, "tenant": "team-1", "priority": 5})
    (tmp_path / "terms.jsonl").write_text(f"{first}\n{other}\n")
    with pytest.raises(InvalidArgument, match="line 2: tenant 'team-1' is listed before with max_concurrency 3"):
        ApiKeys.load(tmp_path / "terms.jsonl")


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
