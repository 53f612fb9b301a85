"""The gRPC API's newer calls and fields on a real gateway (tiny models): n choices, Tokenize, model info."""

from __future__ import annotations

import grpc
import pytest

from gateway_harness import ServerThread, tiny_backend
from tandem.core.config import SamplingParams
from tandem.engines.local import build_engine
from tandem.sessions import MemorySessionStore
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc

PROMPT = [5, 17, 99, 3, 42, 8]
TOKENS = 16


@pytest.fixture(scope="module")
def server(tiny_models):
    target, draft, _ = tiny_models
    running = ServerThread(tiny_backend(target, draft), sessions=MemorySessionStore())
    yield running
    running.stop()


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield generation_pb2_grpc.GenerationServiceStub(channel)


def _request(n: int = 1, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), n=n, ignore_eos=True,
                              sampling=pb.SamplingParams(max_tokens=TOKENS, **sampling))


def _choices(responses) -> tuple[dict[int, list[int]], dict[int, pb.Complete]]:
    """Each choice's token ids and Complete; asserts a choice sends nothing after its Complete."""
    ids: dict[int, list[int]] = {}
    completes: dict[int, pb.Complete] = {}
    for response in responses:
        if response.HasField("chunk"):
            assert response.chunk.index not in completes
            ids.setdefault(response.chunk.index, []).extend(response.chunk.token_ids)
        else:
            completes[response.complete.index] = response.complete
    return ids, completes


def _plain(target, seed: int | None = None, temperature: float = 0.0) -> list[int]:
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=TOKENS, ignore_eos=True)
    return build_engine(target, None).generate([PROMPT], params)[0].token_ids


def test_n_greedy_choices_each_equal_plain_decoding(stub, tiny_models) -> None:
    ids, completes = _choices(stub.Generate(_request(n=3, temperature=0.0), timeout=60))
    want = _plain(tiny_models[0])
    assert sorted(completes) == [0, 1, 2] and all(ids[i] == want for i in range(3))
    assert {c.usage.completion_tokens for c in completes.values()} == {TOKENS}
    assert len({c.request_id for c in completes.values()}) == 1  # one request, n choices


def test_n_seeded_choices_differ_and_choice_zero_is_the_seeds_plain_sample(stub, tiny_models) -> None:
    ids, completes = _choices(stub.Generate(_request(n=4, temperature=1.0, seed=11), timeout=60))
    assert sorted(completes) == [0, 1, 2, 3]
    assert ids[0] == _plain(tiny_models[0], seed=11, temperature=1.0)
    assert len({tuple(choice) for choice in ids.values()}) > 1  # each choice draws its own seed
    again, _ = _choices(stub.Generate(_request(n=4, temperature=1.0, seed=11), timeout=60))
    assert again == ids  # and reproducibly so


def test_n_out_of_range_is_invalid(stub) -> None:
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(_request(n=17, temperature=0.0), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("n:")


def test_abort_stops_every_choice_and_frees_caches(stub, server) -> None:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), n=3, request_id="many", ignore_eos=True,
                                 sampling=pb.SamplingParams(max_tokens=2000, temperature=0.0))
    call = stub.Generate(request, timeout=120)
    first = next(call)
    assert first.HasField("chunk")
    assert stub.Abort(pb.AbortRequest(request_id="many"), timeout=10).found
    _, completes = _choices(call)
    assert sorted(completes) == [0, 1, 2] or len(completes) < 3  # aborted choices end, none runs to 2000
    assert all(c.finish_reason == pb.FINISH_REASON_ABORT for c in completes.values())
    assert server.wait_for(server.caches_empty)


def test_tokenize_prompt_and_chat(stub, tiny_models) -> None:
    tokenizer = tiny_models[0].tokenizer
    got = stub.Tokenize(pb.TokenizeRequest(prompt="def f(x): return x"), timeout=10)
    assert list(got.token_ids) == tokenizer.encode("def f(x): return x")
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")])
    if getattr(tokenizer, "chat_template", None):
        got = stub.Tokenize(pb.TokenizeRequest(chat=chat), timeout=10)
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True)
        assert list(got.token_ids) == tokenizer.encode(text, add_special_tokens=False)
    with pytest.raises(grpc.RpcError) as info:
        stub.Tokenize(pb.TokenizeRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("input: set one of")
    with pytest.raises(grpc.RpcError) as info:
        stub.Tokenize(pb.TokenizeRequest(prompt=""), timeout=10)  # set, but empty: named as Generate names it
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "prompt: must not be empty")


def test_model_info_reports_context_and_tokenizer(stub, server, tiny_models) -> None:
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    target = tiny_models[0]
    assert info.context_length == target.model.config.max_position_embeddings > 0
    assert set(info.tokenizer.eos_token_ids) == set(server.engine.eos_token_ids)
    assert info.tokenizer.chat_template == bool(getattr(target.tokenizer, "chat_template", None))
    assert info.tokenizer.max_prompt_tokens == server.gateway.generations.limits.max_prompt_tokens
