"""Tenants (API keys) on real gateways over TLS, tiny models: their request and session ids, cached prompt prefixes,
stored responses, conversations, files and batches kept apart, per-tenant concurrency caps, and each tenant's share
of the queue."""

from __future__ import annotations

import json
import time

import grpc
import pytest

from gateway_harness import ServerThread, tiny_backend
from security_harness import (  # the fixtures by their names: keys, pki, server
    GREEDY,
    PROMPT,
    _client,
    _http,
    keys_fixture,  # noqa: F401
    pki_fixture,  # noqa: F401
    server_fixture,  # noqa: F401
)
from tandem.cli.main import build_parser
from tandem.cli.serving import gateway_options
from tandem.errors import InvalidArgument
from tandem.gateway.auth import ApiKeys
from tandem.sessions import MemorySessionStore
from tandem.v1 import generation_pb2 as pb

LONG = 4000  # max_tokens of a request that is still running when the test acts on it


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
