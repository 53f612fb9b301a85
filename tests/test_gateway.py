"""The gateway end to end: a real gRPC server on loopback, tiny models, the Python clients."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch

from gateway_harness import ServerThread, tiny_backend, window_past_budget
from tandem.client import AsyncTandemClient, TandemClient
from tandem.core.config import SamplingParams
from tandem.core.detok import REPLACEMENT
from tandem.engines.local import build_engine
from tandem.errors import RequestRefused
from tandem.gateway.server import READINESS_SERVICE, SERVING
from tandem.gateway.validate import GatewayLimits
from tandem.sessions import MemorySessionStore
from tandem.v1 import generation_pb2 as pb

ROOT = Path(__file__).resolve().parent.parent
NEW_TOKENS = 24
GREEDY = {"temperature": 0.0, "max_tokens": NEW_TOKENS, "ignore_eos": True}
SESSIONS = MemorySessionStore()


def _prompts(vocab: int, count: int = 32) -> list[list[int]]:
    generator = torch.Generator().manual_seed(4321)
    lengths = torch.randint(1, 30, (count,), generator=generator)
    return [torch.randint(0, vocab, (int(n),), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="module")
def server(tiny_models):
    target, draft, _ = tiny_models
    running = ServerThread(tiny_backend(target, draft), sessions=SESSIONS,
                           limits=GatewayLimits(max_prompt_tokens=512))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def references(tiny_models):
    """In-process plain (no draft) greedy decoding of the same prompts."""
    target = tiny_models[0]
    prompts = _prompts(256)
    plain = build_engine(target, None)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return prompts, [r.token_ids for r in plain.generate(prompts, params)]


def _stream(client: TandemClient, **options) -> tuple[list[pb.Chunk], pb.Complete]:
    items = list(client.generate(**options))
    assert isinstance(items[-1], pb.Complete) and all(isinstance(i, pb.Chunk) for i in items[:-1])
    return items[:-1], items[-1]


def test_proto_codegen_is_current() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_greedy_through_server_equals_plain_decoding(server, references, tiny_models) -> None:
    prompts, expected = references
    tokenizer = tiny_models[0].tokenizer
    with TandemClient(server.address, timeout=60) as client:
        for prompt, want in zip(prompts[:30], expected, strict=False):
            chunks, complete = _stream(client, token_ids=prompt, **GREEDY)
            ids = [t for c in chunks for t in c.token_ids]
            assert ids == want
            assert "".join(c.text for c in chunks) == tokenizer.decode(want, skip_special_tokens=True)
            assert complete.finish_reason == pb.FINISH_REASON_LENGTH and complete.request_id.startswith("req-")
            assert complete.usage.prompt_tokens == len(prompt) and complete.usage.completion_tokens == NEW_TOKENS
        assert complete.speculation.drafted_tokens > 0 and complete.speculation.rounds > 0
        _, off = _stream(client, token_ids=prompts[0], speculation="off", **GREEDY)
        capped_chunks, capped = _stream(client, token_ids=prompts[1], max_k=1, **GREEDY)
    assert off.speculation.drafted_tokens == 0 and off.usage.completion_tokens == NEW_TOKENS
    assert len(capped.speculation.acceptance_per_position) <= 1
    assert [t for c in capped_chunks for t in c.token_ids] == expected[1]
    assert server.wait_for(server.caches_empty)


def test_32_concurrent_streams(server, references) -> None:
    prompts, expected = references

    async def run_all() -> list[list[int]]:
        async with AsyncTandemClient(server.address, timeout=60) as client:
            async def one(prompt: list[int]) -> list[int]:
                return [t async for item in client.generate(token_ids=prompt, **GREEDY)
                        if isinstance(item, pb.Chunk) for t in item.token_ids]

            return await asyncio.gather(*(one(p) for p in prompts))

    outputs = asyncio.run(run_all())
    assert len(outputs) == 32
    mismatched = [i for i, (got, want) in enumerate(zip(outputs, expected, strict=True)) if got != want]
    assert not mismatched
    assert server.wait_for(server.caches_empty)


def test_chat_and_raw_prompts_tokenize_like_the_model(server, tiny_models) -> None:
    target = tiny_models[0]
    engine = build_engine(target, None)
    chat_text = target.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                     add_generation_prompt=True)
    cases = [({"prompt": "def add(a, b):"}, target.tokenizer.encode("def add(a, b):")),
             ({"chat": [("user", "hi")]}, target.tokenizer.encode(chat_text, add_special_tokens=False))]
    with TandemClient(server.address, timeout=60) as client:
        for request, ids in cases:
            chunks, complete = _stream(client, **request, **GREEDY)
            want = engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
            assert [t for c in chunks for t in c.token_ids] == want[0].token_ids
            assert complete.usage.prompt_tokens == len(ids)


def test_utf8_chunks_never_split_a_character(server, tiny_models) -> None:
    tokenizer = tiny_models[0].tokenizer
    held_back = 0
    prompts = ["héllo wörld", "日本語のテキスト", "€ ∑ 😀 ✓", "naïve café", "Привет мир", "ñandú Ωmega 数学"]
    with TandemClient(server.address, timeout=60) as client:
        for seed, prompt in enumerate(prompts * 3):
            chunks, _ = _stream(client, prompt=prompt, temperature=1.0, seed=seed, max_tokens=48, ignore_eos=True)
            ids = [t for c in chunks for t in c.token_ids]
            final = tokenizer.decode(ids, skip_special_tokens=True)
            assert "".join(c.text for c in chunks) == final
            offset, prefix = 0, []
            for chunk in chunks:
                # A replacement character in a chunk must be a genuinely invalid byte in the final text too.
                assert all(final[offset + i] == REPLACEMENT for i, ch in enumerate(chunk.text) if ch == REPLACEMENT)
                offset += len(chunk.text)
                prefix += chunk.token_ids
                partial = tokenizer.decode(prefix, skip_special_tokens=True)
                complete_part = partial.rstrip(REPLACEMENT)
                if complete_part != partial and len(complete_part) < len(final):
                    held_back += final[len(complete_part)] != REPLACEMENT
    assert held_back > 0, "no multi-byte character was split across chunks; the test proves nothing"


def test_stop_strings_cut_text_like_the_engine(server, tiny_models) -> None:
    engine = build_engine(tiny_models[0], None)
    prompt = [5, 17, 99, 3]
    sample = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0].text
    stop = sample[12:14]
    want = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                    stop=(stop,)))[0]
    with TandemClient(server.address, timeout=60) as client:
        chunks, complete = _stream(client, token_ids=prompt, temperature=0.0, max_tokens=40, ignore_eos=True,
                                   stop=[stop])
    assert "".join(c.text for c in chunks) == want.text
    assert complete.finish_reason == pb.FINISH_REASON_STOP and stop not in want.text


def test_sessions_save_policy_state(server, references) -> None:
    prompts, _ = references
    with TandemClient(server.address, timeout=60) as client:
        client.generate_text(token_ids=prompts[2], session_id="session-a", **GREEDY)
    assert server.wait_for(lambda: SESSIONS.get("session-a") is not None)
    assert {"accepted", "rejected", "k", "fallback"} <= SESSIONS.get("session-a").keys()
    with TandemClient(server.address, timeout=60) as client:
        _, complete = client.generate_text(token_ids=prompts[2], session_id="session-a", **GREEDY)
    assert complete.usage.completion_tokens == NEW_TOKENS


def test_client_cancel_and_deadline_free_caches(server, references) -> None:
    prompts, _ = references
    with TandemClient(server.address, timeout=60) as client:
        stream = client.generate(token_ids=prompts[3], temperature=0.0, max_tokens=4000, ignore_eos=True)
        for _ in range(3):
            assert isinstance(next(stream), pb.Chunk)
        stream.close()
        assert server.wait_for(lambda: server.caches_empty() and server.gateway.loop.active == 0)
        with pytest.raises(grpc.RpcError) as caught:
            client.generate_text(token_ids=prompts[4], temperature=0.0, max_tokens=4000, ignore_eos=True, timeout=0.3)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert server.wait_for(lambda: server.caches_empty() and server.gateway.loop.active == 0)
        assert client.health_status(READINESS_SERVICE) == SERVING


def test_abort_rpc_ends_the_stream_with_abort(server, references) -> None:
    prompts, _ = references
    with TandemClient(server.address, timeout=60) as client:
        stream = client.generate(token_ids=prompts[5], request_id="to-abort", temperature=0.0, max_tokens=4000,
                                 ignore_eos=True)
        assert isinstance(next(stream), pb.Chunk)
        assert client.abort("to-abort") is True
        complete = next(item for item in stream if isinstance(item, pb.Complete))
        assert complete.finish_reason == pb.FINISH_REASON_ABORT and complete.request_id == "to-abort"
        assert 0 < complete.usage.completion_tokens < 4000
        assert client.abort("to-abort") is False and client.abort("never-existed") is False
    assert server.wait_for(server.caches_empty)


def test_model_info(server, references) -> None:
    with TandemClient(server.address, timeout=10) as client:
        client.generate_text(token_ids=references[0][0], temperature=0.0, max_tokens=12)  # rounds feed the costs
        info = client.model_info()
    assert (info.target_model, info.draft_model, info.vocab_size) == ("tiny-target", "tiny-draft", 320)
    assert info.max_k == 8 and info.draft_workers == 1 and info.target_replicas == 1
    costs = info.costs  # measured on served rounds: k = 4 drafts, verified over 5 tokens
    assert costs.draft_step_seconds > 0 and costs.forward_seconds[5] > 0 and 0 < costs.acceptance_prior < 1


def test_model_info_reports_kv_usage(tiny_models, references) -> None:
    """Each model's KV tokens under the budget build_engine was given: used by the session retained after a request,
    reserved by the slots allocated for it; no draft figures when not speculating."""
    target, draft, _ = tiny_models
    running = ServerThread(tiny_backend(target, draft, kv_tokens=2048), sessions=MemorySessionStore())
    plain = ServerThread(tiny_backend(target, None, kv_tokens=1024))
    try:
        with TandemClient(running.address, timeout=60) as client:
            before = client.model_info()
            client.generate_text(token_ids=references[0][0], session_id="kv", temperature=0.0, max_tokens=12)
            after = client.model_info()
        engine = running.engine
        held = (engine.verifier.runner.kv_tokens_used, engine.drafter.runner.kv_tokens_used)
        with TandemClient(plain.address, timeout=60) as client:
            plain_info = client.model_info()
    finally:
        running.stop()
        plain.stop()
    for kv in (before.target_kv, before.draft_kv):
        assert (kv.used_tokens, kv.reserved_tokens, kv.capacity_tokens) == (0, 0, 2048)
    for kv, used in zip((after.target_kv, after.draft_kv), held, strict=True):
        assert kv.capacity_tokens == 2048 and 0 < kv.used_tokens <= kv.reserved_tokens <= 2048
        assert kv.used_tokens == used >= len(references[0][0])  # the retained session: its prompt and more
    assert plain_info.target_kv.capacity_tokens == 1024 and not plain_info.HasField("draft_kv")


def test_a_request_past_the_kv_budget_fails_alone_with_invalid_argument(tiny_models, references) -> None:
    """A sequence longer than a worker's whole KV budget can never run. The gateway refuses it before it runs (the
    context window it reads is the budget); where a worker holds less than the window the gateway was told, the
    engine refuses it once it gets there: INVALID_ARGUMENT naming the budget, and a request beside it completes."""
    target, _, _ = tiny_models
    prompts, expected = references
    checked = ServerThread(tiny_backend(target, None, kv_tokens=96))
    try:
        assert checked.gateway.generations.model_limits.context_window == 96
        with pytest.raises(grpc.RpcError) as refused:
            TandemClient(checked.address, timeout=60).generate_text(token_ids=list(range(3, 63)), max_tokens=80)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith("max_tokens:") and "context window of 96" in refused.value.details()
    finally:
        checked.stop()
    running = ServerThread(window_past_budget(tiny_backend(target, None, kv_tokens=96)))

    async def tokens(client: AsyncTandemClient, **options) -> list[int]:
        return [t for item in [i async for i in client.generate(**options)] if isinstance(item, pb.Chunk)
                for t in item.token_ids]

    async def both() -> list:
        async with AsyncTandemClient(running.address, timeout=60) as client:
            long = tokens(client, token_ids=list(range(3, 63)), temperature=0.0, max_tokens=80, ignore_eos=True)
            short = tokens(client, token_ids=prompts[0], temperature=0.0, max_tokens=8, ignore_eos=True)
            return await asyncio.gather(long, short, return_exceptions=True)

    try:
        failure, short = asyncio.run(both())
    finally:
        running.stop()
    assert isinstance(failure, grpc.aio.AioRpcError) and failure.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "budget of 96" in failure.details() and "--kv-tokens" in failure.details()
    assert short == expected[0][:8]


def test_a_refusal_naming_no_running_request_fails_the_step_instead_of_repeating_it(tiny_models) -> None:
    """A refusal is raised before anything is committed, so the step runs again without the request it names; one
    that names none of the running requests would be raised at every step: the step's requests fail instead."""
    def load():
        backend = tiny_backend(tiny_models[0], None)()

        def refuse(requests):
            raise RequestRefused("nobody", "response_format: refused a row it was not sent")
        backend.engine.verifier.verify = refuse
        return backend

    running = ServerThread(load)
    try:
        with TandemClient(running.address, timeout=30) as client, pytest.raises(grpc.RpcError) as failed:
            client.generate_result(token_ids=[3, 4, 5], max_tokens=4, temperature=0.0)
    finally:
        running.stop()
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not sent" in failed.value.details()


def test_request_id_is_reusable_after_cancel(server, references) -> None:
    prompts, expected = references
    with TandemClient(server.address, timeout=60) as client:
        stream = client.generate(token_ids=prompts[6], request_id="reused", temperature=0.0, max_tokens=4000,
                                 ignore_eos=True)
        next(stream)
        stream.close()
        for _ in range(100):  # the server learns of the cancellation a moment later
            try:
                chunks, complete = _stream(client, token_ids=prompts[6], request_id="reused", **GREEDY)
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT and "already running" in exc.details()
                time.sleep(0.02)
    assert [t for c in chunks for t in c.token_ids] == expected[6] and complete.finish_reason == pb.FINISH_REASON_LENGTH
    assert server.wait_for(server.caches_empty)
