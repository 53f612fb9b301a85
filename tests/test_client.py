"""tandem.client against real servers: the gateway on tiny models (streams, collected results, n choices, logprobs,
tokenize, model info, the CLI through the client), a small grpc server with a metadata-capturing interceptor behind
plaintext, TLS and mutual-TLS ports (certificates made here), and the torch-free client install."""

from __future__ import annotations

import asyncio
import inspect
import json
import subprocess
import sys
import tomllib
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway_harness import ServerThread, tiny_backend
from pki import make_pki
from tandem.cli.main import main
from tandem.client import (
    AsyncTandemClient,
    GenerateOptions,
    TandemClient,
    Usage,
    build_request,
)
from tandem.errors import InvalidArgument
from tandem.sessions import MemorySessionStore
from tandem.v1 import generation_pb2 as pb

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [5, 17, 99, 3, 42, 8]
TOKENS = 12
GREEDY = {"temperature": 0.0, "max_tokens": TOKENS, "ignore_eos": True}
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def server(tiny_models):
    target, draft, _ = tiny_models
    running = ServerThread(tiny_backend(target, draft), sessions=MemorySessionStore())
    yield running
    running.stop()


# --- requests -----------------------------------------------------------------------------------------------------


def test_build_request_maps_typed_parameters() -> None:
    request = build_request(chat=[{"role": "system", "content": "s"}, ("user", "hi")], max_tokens=7, temperature=0.5,
                            top_p=0.9, top_k=4, seed=3, stop="\n", stop_token_ids=[2], ignore_eos=True,
                            speculation="off", max_k=2, session_id="s1", request_id="r1", n=3, logprobs=0, priority=2)
    assert request.priority == 2
    assert [(m.role, m.content) for m in request.chat.messages] == [("system", "s"), ("user", "hi")]
    assert (request.sampling.max_tokens, request.sampling.top_k, request.sampling.seed) == (7, 4, 3)
    assert request.sampling.temperature == pytest.approx(0.5) and request.sampling.top_p == pytest.approx(0.9)
    assert list(request.stop) == ["\n"] and list(request.stop_token_ids) == [2]  # a lone string is one stop
    assert request.speculation.mode == pb.SpeculationOptions.MODE_OFF and request.speculation.max_k == 2
    assert (request.session_id, request.request_id, request.n, request.ignore_eos) == ("s1", "r1", 3, True)
    assert request.HasField("logprobs") and request.logprobs == 0
    plain = build_request("x")
    assert not plain.HasField("logprobs") and not plain.sampling.HasField("temperature")  # server defaults
    assert not plain.speculation.HasField("max_k") and plain.n == 1
    with pytest.raises(InvalidArgument, match="input:"):
        build_request("x", token_ids=[1])
    with pytest.raises(InvalidArgument, match="speculation:"):
        build_request("x", speculation="sometimes")
    # Values the wire cannot carry raised protobuf's ValueError / TypeError, naming no field.
    with pytest.raises(InvalidArgument, match=r"^seed: Value out of range: -1"):
        build_request("x", seed=-1)
    with pytest.raises(InvalidArgument, match=r"^max_tokens: "):
        build_request("x", max_tokens=2.5)
    with pytest.raises(InvalidArgument, match=r"^priority: "):
        build_request("x", priority=2**40)
    shaped = build_request("x", repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=-0.25,
                           logit_bias={7: -100.0, 3: 2.5}, min_p=0.05)
    assert shaped.sampling.min_p == pytest.approx(0.05) and not plain.sampling.HasField("min_p")
    assert shaped.sampling.repetition_penalty == pytest.approx(1.1) and shaped.sampling.presence_penalty == 0.5
    assert shaped.sampling.frequency_penalty == -0.25 and dict(shaped.sampling.logit_bias) == {7: -100.0, 3: 2.5}
    assert not plain.sampling.HasField("repetition_penalty") and not plain.sampling.logit_bias
    # The methods' typed **options are build_request's keywords, nothing more or less.
    keywords = [name for name in inspect.signature(build_request).parameters if name != "prompt"]
    assert list(GenerateOptions.__annotations__) == keywords
    for method in (TandemClient.generate, AsyncTandemClient.generate, TandemClient.generate_result):
        parameters = inspect.signature(method).parameters
        assert list(parameters) == ["self", "prompt", "timeout", "options"]
        assert parameters["options"].annotation == "Unpack[GenerateOptions]"


# --- against the gateway ------------------------------------------------------------------------------------------


def test_sync_stream_and_collected_result_agree(server) -> None:
    with TandemClient(server.address, timeout=60) as client:
        items = list(client.generate(token_ids=PROMPT, **GREEDY))
        result = client.generate_result(token_ids=PROMPT, **GREEDY)
        text, complete = client.generate_text(token_ids=PROMPT, **GREEDY)
        assert client.health_status() == SERVING and client.health_status("tandem.v1.GenerationService") == SERVING
        assert client.abort("no-such-request") is False
    chunks, last = items[:-1], items[-1]
    assert isinstance(last, pb.Complete) and all(isinstance(c, pb.Chunk) for c in chunks)
    ids = [t for c in chunks for t in c.token_ids]
    assert len(ids) == TOKENS and result.token_ids == ids
    assert result.text == "".join(c.text for c in chunks) == text
    assert result.finish_reason == "length" and complete.finish_reason == pb.FINISH_REASON_LENGTH
    assert result.usage == Usage(len(PROMPT), TOKENS)
    assert result.speculation.rounds > 0 and result.speculation.drafted_tokens > 0
    assert 0 <= result.speculation.acceptance_rate <= 1
    assert result.request_id and [c.index for c in result.choices] == [0] and result.choices[0].logprobs is None


def test_async_stream_and_result(server) -> None:
    async def run() -> tuple[list[int], list[int], pb.GetModelInfoResponse, int]:
        async with AsyncTandemClient(server.address, timeout=60) as client:
            streamed = [t async for item in client.generate(token_ids=PROMPT, **GREEDY)
                        if isinstance(item, pb.Chunk) for t in item.token_ids]
            result = await client.generate_result(token_ids=PROMPT, speculation="off", **GREEDY)
            assert result.speculation.drafted_tokens == 0 and result.finish_reason == "length"
            return streamed, result.token_ids, await client.model_info(), await client.health_status()

    streamed, plain, info, status = asyncio.run(run())
    assert streamed == plain and len(streamed) == TOKENS  # greedy: speculation changes nothing
    assert info.target_model == "tiny-target" and info.draft_model == "tiny-draft" and info.vocab_size > 0
    assert status == SERVING


def test_n_choices(server) -> None:
    with TandemClient(server.address, timeout=60) as client:
        one = client.generate_result(token_ids=PROMPT, **GREEDY)
        greedy = client.generate_result(token_ids=PROMPT, n=2, **GREEDY)
        sampled = client.generate_result(token_ids=PROMPT, n=3, temperature=1.0, seed=7, max_tokens=TOKENS,
                                         ignore_eos=True)
        again = client.generate_result(token_ids=PROMPT, n=3, temperature=1.0, seed=7, max_tokens=TOKENS,
                                       ignore_eos=True)
    assert [c.index for c in greedy.choices] == [0, 1]
    assert all(c.token_ids == one.token_ids for c in greedy.choices)
    assert greedy.usage == Usage(len(PROMPT), 2 * TOKENS)
    assert [len(c.token_ids) for c in sampled.choices] == [TOKENS] * 3
    assert [c.token_ids for c in sampled.choices] == [c.token_ids for c in again.choices]  # seeded: repeatable


def test_logprobs_come_with_every_token(server) -> None:
    with TandemClient(server.address, timeout=60) as client:
        result = client.generate_result(token_ids=PROMPT, logprobs=2, **GREEDY)
    (choice,) = result.choices
    assert [lp.token_id for lp in choice.logprobs] == choice.token_ids
    for lp in choice.logprobs:
        assert lp.logprob <= 0 and len(lp.top) == 2 and lp.top[0][1] >= lp.top[1][1]
        # greedy: the emitted token is the most likely one (a near tie may list another first, float noise apart)
        assert lp.logprob >= lp.top[0][1] - 1e-4, (choice.token_ids, choice.logprobs)


def test_tokenize_matches_the_models_tokenizer(server, tiny_models) -> None:
    tokenizer = tiny_models[0].tokenizer
    chat = [{"role": "user", "content": "hi"}]
    chat_text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    with TandemClient(server.address, timeout=60) as client:
        ids = client.tokenize("def add(a, b):")
        assert ids == tokenizer.encode("def add(a, b):")
        assert client.tokenize(chat=chat) == tokenizer.encode(chat_text, add_special_tokens=False)
        by_text = client.generate_result("def add(a, b):", **GREEDY)
        by_ids = client.generate_result(token_ids=ids, **GREEDY)
    assert by_text.token_ids == by_ids.token_ids and by_text.usage.prompt_tokens == len(ids)
    with pytest.raises(InvalidArgument):
        TandemClient(server.address).tokenize()


def test_cli_generate_address_goes_through_the_client(server, capsys, tmp_path) -> None:
    code = main(["generate", "def add(a, b):", "--address", server.address, "--temperature", "0",
                 "--max-tokens", str(TOKENS), "--ignore-eos", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    with TandemClient(server.address, timeout=60) as client:
        result = client.generate_result("def add(a, b):", **GREEDY)
    assert out["token_ids"] == result.token_ids and out["finish_reason"] == "length"
    assert out["stats"]["drafted"] > 0 and out["request_id"]
    expected = tmp_path / "expected.txt"
    expected.write_text(out["text"], encoding="utf-8")
    code = main(["generate", "def add(a, b):", "--address", server.address, "--temperature", "0",
                 "--max-tokens", str(TOKENS), "--ignore-eos", "--json", "--prediction", str(expected),
                 "--min-tokens", "3"])
    predicted = json.loads(capsys.readouterr().out)
    assert code == 0 and predicted["token_ids"] == result.token_ids
    assert {"predicted_rounds", "accepted_prediction_tokens", "rejected_prediction_tokens"} <= predicted["stats"].keys()
    assert predicted["stats"]["predicted_rounds"] > 0


# --- metadata and TLS against a small grpc server -----------------------------------------------------------------


class Capture(grpc.ServerInterceptor):
    """Records each call's method and metadata before the handler (or UNIMPLEMENTED) runs."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, str]]] = []

    def intercept_service(self, continuation, handler_call_details):
        self.calls.append((handler_call_details.method, dict(handler_call_details.invocation_metadata)))
        return continuation(handler_call_details)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, all signed by the CA, plus an
    unrelated CA; the CA is also written to a file (the client takes paths)."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def health_server(pki):
    """The grpc health service on three loopback ports: plaintext, TLS, and TLS requiring a client certificate."""
    capture = Capture()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=[capture])
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    plain = server.add_insecure_port("127.0.0.1:0")
    tls = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([pki["server"]]))
    mtls = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
        [pki["server"]], root_certificates=pki["ca"], require_client_auth=True))
    server.start()
    yield {"capture": capture, "plain": f"127.0.0.1:{plain}", "tls": f"127.0.0.1:{tls}",
           "mtls": f"127.0.0.1:{mtls}"}
    server.stop(0)


def test_api_key_is_sent_on_every_call(health_server, monkeypatch, capsys) -> None:
    capture = health_server["capture"]
    capture.calls.clear()
    with TandemClient(health_server["plain"], api_key="k-123", timeout=10) as client:
        assert client.health_status() == SERVING
        for call in (lambda: list(client.generate("hi")), lambda: client.tokenize("hi"), client.model_info,
                     lambda: client.abort("r")):
            with pytest.raises(grpc.RpcError) as failed:  # the health server implements none of them
                call()
            assert failed.value.code() == grpc.StatusCode.UNIMPLEMENTED

    async def async_calls() -> int:
        async with AsyncTandemClient(health_server["plain"], api_key="k-456", timeout=10) as client:
            return await client.health_status()

    assert asyncio.run(async_calls()) == SERVING
    with TandemClient(health_server["plain"], timeout=10) as client:
        client.health_status()
    monkeypatch.setenv("TANDEM_API_KEY", "k-cli")
    assert main(["generate", "hi", "--address", health_server["plain"]]) == 2  # UNIMPLEMENTED, key sent
    assert "UNIMPLEMENTED" in capsys.readouterr().err
    methods = [method.rsplit("/", 1)[1] for method, _ in capture.calls]
    assert methods == ["Check", "Generate", "Tokenize", "GetModelInfo", "Abort", "Check", "Check", "Generate"]
    keys = [metadata.get("authorization") for _, metadata in capture.calls]
    assert keys == ["Bearer k-123"] * 5 + ["Bearer k-456", None, "Bearer k-cli"]
    with pytest.raises(InvalidArgument, match="api_key"):
        TandemClient(health_server["plain"], api_key="a\nb")


def test_tls_handshake_with_a_self_signed_ca(health_server, pki) -> None:
    capture = health_server["capture"]
    capture.calls.clear()
    with TandemClient(health_server["tls"], tls=True, root_certificates=pki["ca_path"], api_key="k-tls",
                      timeout=10) as client:
        assert client.health_status() == SERVING
    assert capture.calls[-1][1]["authorization"] == "Bearer k-tls"

    async def over_tls() -> int:
        async with AsyncTandemClient(health_server["tls"], tls=True, root_certificates=pki["ca"],
                                     timeout=10) as client:
            return await client.health_status()

    assert asyncio.run(over_tls()) == SERVING
    # A client that trusts another CA, or speaks plaintext to the TLS port, gets no answer.
    for client in (TandemClient(health_server["tls"], tls=True, root_certificates=pki["other_ca"], timeout=3),
                   TandemClient(health_server["tls"], timeout=3)):
        with client, pytest.raises(grpc.RpcError) as failed:
            client.health_status()
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls(health_server, pki) -> None:
    key, chain = pki["client"]
    with TandemClient(health_server["mtls"], tls=True, root_certificates=pki["ca"], private_key=key,
                      certificate_chain=chain.decode(), timeout=10) as client:  # PEM text works as well as bytes
        assert client.health_status() == SERVING
    with TandemClient(health_server["mtls"], tls=True, root_certificates=pki["ca"], timeout=3) as client, \
            pytest.raises(grpc.RpcError) as failed:
        client.health_status()
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(InvalidArgument, match="tls"):
        TandemClient(health_server["mtls"], root_certificates=pki["ca"])
    with pytest.raises(InvalidArgument, match="private_key"):
        TandemClient(health_server["mtls"], tls=True, private_key=key)


# --- the client install -------------------------------------------------------------------------------------------

# Runs the CLI in a fresh interpreter where the server stack cannot be imported (what `pip install tandem` gives).
WITHOUT_SERVER_STACK = """
import importlib.abc, sys
BLOCKED = {"torch", "transformers", "tokenizers", "numpy", "ray", "redis", "opentelemetry", "safetensors", "gguf",
           "accelerate", "prometheus_client", "grpc_reflection", "fastapi", "uvicorn", "httpx", "tqdm"}

class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, Blocked())
from tandem.client import TandemClient
from tandem.cli.main import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
loaded = sorted(BLOCKED & {name.split(".")[0] for name in sys.modules})
sys.exit(f"imported {loaded}" if loaded else code)
"""


def _without_server_stack(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_SERVER_STACK, *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def test_client_and_remote_generate_need_no_server_stack(server) -> None:
    assert _without_server_stack("--help").returncode == 0
    proc = _without_server_stack("generate", "def add(a, b):", "--address", server.address, "--temperature", "0",
                                 "--max-tokens", "6", "--ignore-eos", "--json")
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["token_ids"]) == 6
    for command, extra in ((["serve", "--port", "0"], "server"), (["generate", "hi"], "server"),
                           (["gateway", "--pools", "p"], "gateway")):
        proc = _without_server_stack(*command)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert f"needs the {extra} stack" in proc.stderr, command
        assert f"pip install '.[{extra}]' in tandem's checkout" in proc.stderr, command


def test_base_dependencies_are_the_client_alone() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {dep.split(">")[0].split("=")[0].split("<")[0].strip() for dep in project["dependencies"]}
    assert names == {"grpcio", "grpcio-health-checking", "protobuf"}
    extras = project["optional-dependencies"]
    assert any(dep.startswith("torch==") for dep in extras["server"])
    # A gateway over shared pools installs without torch (`.ci/run` runs one from such an install: test_pools.py).
    assert "tandem[gateway]" in extras["server"] and not any(dep.startswith("torch") for dep in extras["gateway"])
    assert any(dep.startswith("tandem[") and "server" in dep for dep in extras["dev"])
