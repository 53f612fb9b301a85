"""Gateway failure paths on real servers: bad requests, queue limits, loading and draining, engine faults."""

from __future__ import annotations

import threading
import time

import grpc
import httpx
import pytest

from gateway_harness import ServerThread, tiny_backend
from tandem.client import TandemClient
from tandem.gateway.handles import Submission
from tandem.gateway.server import LIVENESS_SERVICE, NOT_SERVING, READINESS_SERVICE, SERVING
from tandem.gateway.validate import GatewayLimits
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc

INVALID = grpc.StatusCode.INVALID_ARGUMENT
LONG = {"temperature": 0.0, "max_tokens": 4000, "ignore_eos": True}


def _request(**fields) -> pb.GenerateRequest:
    base = {"token_ids": pb.TokenIds(ids=[1, 2, 3]), "sampling": pb.SamplingParams(temperature=0.0, max_tokens=4)}
    return pb.GenerateRequest(**(base | fields))


def _sampling(**fields) -> pb.SamplingParams:
    return pb.SamplingParams(**({"temperature": 0.0, "max_tokens": 4} | fields))


BAD_REQUESTS = [
    ("no input", pb.GenerateRequest(sampling=_sampling()), "input"),
    ("empty prompt", _request(token_ids=None, prompt=""), "prompt"),
    ("empty token ids", _request(token_ids=pb.TokenIds()), "token_ids"),
    ("token id past vocab", _request(token_ids=pb.TokenIds(ids=[1, 320])), "token_ids"),
    ("negative token id", _request(token_ids=pb.TokenIds(ids=[-1])), "token_ids"),
    ("prompt too long", _request(token_ids=pb.TokenIds(ids=[7] * 513)), "token_ids"),
    ("negative temperature", _request(sampling=_sampling(temperature=-0.5)), "temperature"),
    ("nan temperature", _request(sampling=_sampling(temperature=float("nan"))), "temperature"),
    ("top_p zero", _request(sampling=_sampling(top_p=0.0)), "top_p"),
    ("top_p above one", _request(sampling=_sampling(top_p=1.5)), "top_p"),
    ("negative top_k", _request(sampling=_sampling(top_k=-1)), "top_k"),
    ("seed too big", _request(sampling=_sampling(seed=2**64 - 1)), "seed"),
    ("zero max_tokens", _request(sampling=_sampling(max_tokens=0)), "max_tokens"),
    ("max_tokens over limit", _request(sampling=_sampling(max_tokens=5000)), "max_tokens"),
    ("past the context window", _request(sampling=_sampling(max_tokens=4096)), "max_tokens"),
    ("negative stop token", _request(stop_token_ids=[-3]), "stop_token_ids"),
    ("too many stop tokens", _request(stop_token_ids=list(range(65))), "stop_token_ids"),
    ("empty stop string", _request(stop=["ok", ""]), "stop[1]"),
    ("too many stop strings", _request(stop=[f"s{i}" for i in range(17)]), "stop"),
    ("stop string too long", _request(stop=["x" * 257]), "stop[0]"),
    ("unknown speculation mode", _request(speculation=pb.SpeculationOptions(mode=7)), "speculation.mode"),
    ("max_k above k_max", _request(speculation=pb.SpeculationOptions(max_k=9)), "speculation.max_k"),
    ("negative max_k", _request(speculation=pb.SpeculationOptions(max_k=-1)), "speculation.max_k"),
    ("chat without messages", _request(token_ids=None, chat=pb.Chat()), "chat"),
    ("chat with a bad role", _request(token_ids=None, chat=pb.Chat(messages=[pb.ChatMessage(role="robot")])),
     "chat.messages[0].role"),
    ("request_id too long", _request(request_id="r" * 129), "request_id"),
    ("request_id with control characters", _request(request_id="a\nb"), "request_id"),
    ("session_id too long", _request(session_id="s" * 129), "session_id"),
]


@pytest.fixture(scope="module")
def server(tiny_models):
    target, draft, _ = tiny_models
    running = ServerThread(tiny_backend(target, draft), limits=GatewayLimits(max_prompt_tokens=512), max_requests=3)
    yield running
    running.stop()


def test_bad_requests_are_rejected_by_field(server) -> None:
    with grpc.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        wrong = {}
        for name, request, field in BAD_REQUESTS:
            try:
                list(stub.Generate(request, timeout=10))
                wrong[name] = "accepted"
            except grpc.RpcError as exc:
                if exc.code() != INVALID or not exc.details().startswith(field):
                    wrong[name] = f"{exc.code().name}: {exc.details()}"
        with pytest.raises(grpc.RpcError) as caught:
            stub.Abort(pb.AbortRequest(), timeout=10)
        assert caught.value.code() == INVALID
    assert not wrong
    with TandemClient(server.address, timeout=30) as client:
        assert client.health_status(READINESS_SERVICE) == SERVING
        _, complete = client.generate_text(token_ids=[1, 2, 3], max_tokens=8, temperature=0.0, ignore_eos=True)
        assert complete.usage.completion_tokens == 8
    assert server.wait_for(server.caches_empty)


def test_duplicate_request_id_and_queue_full(server) -> None:
    with TandemClient(server.address, timeout=30) as client:
        streams = [client.generate(token_ids=[i + 1], request_id=f"long-{i}", **LONG) for i in range(3)]
        for stream in streams:
            assert isinstance(next(stream), pb.Chunk)
        with pytest.raises(grpc.RpcError) as duplicate:
            client.generate_text(token_ids=[9], request_id="long-0", **LONG)
        assert duplicate.value.code() == INVALID and duplicate.value.details().startswith("request_id")
        with pytest.raises(grpc.RpcError) as full:
            client.generate_text(token_ids=[9], **LONG)
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue full" in full.value.details()
        assert all(client.abort(f"long-{i}") for i in range(3))
        finals = [[item for item in stream if isinstance(item, pb.Complete)] for stream in streams]
        assert [f[0].finish_reason for f in finals] == [pb.FINISH_REASON_ABORT] * 3
        assert server.wait_for(server.caches_empty)
        # Served again after the aborts; EOS ignored, since a sampled first token is EOS about once in 8600 runs.
        assert client.generate_text(token_ids=[9], max_tokens=4, ignore_eos=True)[1].usage.completion_tokens == 4


def test_a_requests_choices_are_no_other_requests_ids(server) -> None:
    """A request of n choices runs them under ids no client can send: another request named like one of them runs
    beside it, and an abort naming one stops no choice (an abort names whole requests). Its own id, sent again with
    any n, is refused while it runs, and an abort of it still stops both choices."""
    with TandemClient(server.address, timeout=30) as client:
        job = client.generate(token_ids=[5], request_id="job", n=2, **LONG)
        assert isinstance(next(job), pb.Chunk)
        assert not client.abort("job/1")
        for n in (1, 2):
            with pytest.raises(grpc.RpcError) as duplicate:
                client.generate_text(token_ids=[9], request_id="job", n=n, max_tokens=4)
            assert duplicate.value.code() == INVALID and duplicate.value.details() == \
                "request_id: 'job' is already running"
        _, complete = client.generate_text(token_ids=[9], request_id="job/1", max_tokens=4, ignore_eos=True)
        assert complete.usage.completion_tokens == 4
        assert client.abort("job")
        finals = [item for item in job if isinstance(item, pb.Complete)]
        assert finals and all(final.finish_reason == pb.FINISH_REASON_ABORT for final in finals)
    assert server.wait_for(server.caches_empty)


def test_readiness_follows_loading_and_draining(tiny_models) -> None:
    target, _, _ = tiny_models
    release = threading.Event()
    load_tiny = tiny_backend(target)

    def slow_load():
        assert release.wait(30)
        return load_tiny()

    running = ServerThread(slow_load, wait_ready=False, grace=30.0)
    try:
        with TandemClient(running.address, timeout=30) as client:
            assert client.health_status(LIVENESS_SERVICE) == SERVING
            assert client.health_status(READINESS_SERVICE) == NOT_SERVING
            for call in (lambda: client.generate_text(prompt="hi"), client.model_info):
                with pytest.raises(grpc.RpcError) as caught:
                    call()
                assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            release.set()
            assert running.wait_for(lambda: client.health_status(READINESS_SERVICE) == SERVING)
            stream = client.generate(token_ids=[4, 5], temperature=0.0, max_tokens=300, ignore_eos=True)
            first = next(stream)
            running.start_drain(grace=30.0)
            assert running.wait_for(lambda: client.health_status(READINESS_SERVICE) == NOT_SERVING)
            with pytest.raises(grpc.RpcError) as refused:
                client.generate_text(prompt="hi")
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            rest = list(stream)
            assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert len(first.token_ids) + sum(len(c.token_ids) for c in rest[:-1]) == 300
        running.call(running.gateway.wait_closed())
    finally:
        release.set()
        running.stop()


def _faulty_server(tiny_models, fault) -> ServerThread:
    """A server whose engine runs `fault()` before each step of a batch holding a prompt starting with 255."""
    target, draft, _ = tiny_models
    load_tiny = tiny_backend(target, draft)

    def load():
        backend = load_tiny()
        engine, real_step = backend.engine, backend.engine.step

        def step():
            if any(seq.prompt[0] == 255 for seq in engine.sequences.values()):
                fault()
            return real_step()

        engine.step = step
        return backend

    return ServerThread(load, stall_timeout=0.4)


def _raise() -> None:
    raise RuntimeError("injected fault")


@pytest.mark.parametrize(("fault", "code", "message"), [
    (_raise, grpc.StatusCode.INTERNAL, "engine step failed"),  # its text stays in the log (test_hardening)
    (lambda: time.sleep(1.5), grpc.StatusCode.UNAVAILABLE, "engine stalled"),
])
def test_engine_faults_fail_requests_then_recover(tiny_models, fault, code, message: str) -> None:
    running = _faulty_server(tiny_models, fault)
    try:
        with TandemClient(running.address, timeout=30) as client:
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as caught:
                client.generate_text(token_ids=[255, 1], max_tokens=16)
            assert caught.value.code() == code and message in caught.value.details()
            assert time.monotonic() - started < 10
            assert running.wait_for(running.caches_empty)
            _, complete = client.generate_text(token_ids=[7, 1], temperature=0.0, max_tokens=16, ignore_eos=True)
            assert complete.usage.completion_tokens == 16
    finally:
        running.stop()


def test_output_its_client_has_not_read_holds_a_queue_place(tiny_models) -> None:
    """A client that stops reading: the engine finished its request and freed the place, and its output piled up in
    the gateway; with no API keys nothing bounded how many such streams one client held (57 MB each measured)."""
    import gc

    from tandem.core.config import SamplingParams
    from tandem.gateway.events import QueueFull

    target, draft, _ = tiny_models
    server = ServerThread(tiny_backend(target, draft), max_requests=2)
    try:
        loop, params = server.gateway.loop, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        handles = [server.call(loop.submit(Submission([1, 2, 3], params, f"r{i}"))) for i in range(2)]
        assert server.wait_for(lambda: loop.active == 0)  # both finished in the engine, neither read
        with pytest.raises(QueueFull, match="2 finished whose clients have not read their output"):
            server.call(loop.submit(Submission([1, 2, 3], params, "r2")))

        async def read(handle) -> int:
            return sum([len(update.token_ids) async for update in handle])

        assert server.call(read(handles[0])) == 8  # read to the end: its place is free
        assert server.call(read(server.call(loop.submit(Submission([1, 2, 3], params, "r3"))))) == 8
        del handles[1]  # a client gone (its stream dropped) frees its place too
        gc.collect()
        assert server.call(read(server.call(loop.submit(Submission([1, 2, 3], params, "r4"))))) == 8
    finally:
        server.stop()


def test_output_unread_for_a_minute_is_dropped_with_its_place(tiny_models, monkeypatch) -> None:
    """A client that keeps its connection open and reads nothing held its queue place for as long: a few such
    connections locked every other client out (429s), with no authentication needed."""
    from tandem.core.config import SamplingParams
    from tandem.gateway import loop as engine_loop
    from tandem.gateway.events import EngineUnavailable

    monkeypatch.setattr(engine_loop, "UNREAD_TIMEOUT_S", 0.5)
    target, draft, _ = tiny_models
    server = ServerThread(tiny_backend(target, draft), max_requests=1)
    try:
        loop, params = server.gateway.loop, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        stalled = server.call(loop.submit(Submission([1, 2, 3], params, "stalled")))
        assert server.wait_for(lambda: loop.active == 0)  # finished, not read
        time.sleep(0.6)
        fresh = server.call(loop.submit(Submission([1, 2, 3], params, "fresh")))  # the stalled one's place, taken back

        async def read(handle) -> int:
            return sum([len(update.token_ids) async for update in handle])

        assert server.call(read(fresh)) == 8
        with pytest.raises(EngineUnavailable, match="output dropped: its client read none of it"):
            server.call(read(stalled))  # its reader, back, is told
    finally:
        server.stop()


def _slow_first_round(tiny_models, seconds: float, prompt_tokens: int, **options) -> ServerThread:
    """A server whose engine sleeps `seconds` in the first round of a request with a prompt of `prompt_tokens`, after
    the step has counted its tokens (as a long prefill would take)."""
    target, draft, _ = tiny_models
    load_tiny = tiny_backend(target, draft)

    def load():
        backend = load_tiny()
        engine, real_round = backend.engine, backend.engine._round

        def slow_round(batch, *rest):
            if any(len(seq.prompt) == prompt_tokens and not seq.output for seq in batch):
                time.sleep(seconds)
            return real_round(batch, *rest)

        engine._round = slow_round
        return backend

    return ServerThread(load, stall_timeout=0.4, **options)


def test_a_long_prompts_step_has_time_for_its_tokens(tiny_models) -> None:
    """One step past --stall-timeout failed every request in flight, though a long prompt prefilled whole (or scored
    for its logprobs) is a long step, not a hung engine: a step may take longer by TARGET_TOKEN_ALLOWANCE_S a token."""
    running = _slow_first_round(tiny_models, 1.5, 200)
    try:
        with TandemClient(running.address, timeout=30) as client:
            _, complete = client.generate_text(token_ids=[5] * 200, temperature=0.0, max_tokens=4, ignore_eos=True)
            assert complete.usage.completion_tokens == 4
    finally:
        running.stop()


def test_readiness_says_so_while_a_step_is_stalled(tiny_models) -> None:
    """The watchdog failed the requests, but /health and gRPC readiness went on saying SERVING."""
    running = _slow_first_round(tiny_models, 7.0, 1, http_port=0)  # one token and k 8: a 4.9 s deadline
    try:
        with TandemClient(running.address, timeout=30) as client:
            codes = []

            def generate() -> None:
                try:
                    client.generate_text(token_ids=[9], max_tokens=4)
                except grpc.RpcError as error:
                    codes.append(error.code())

            failed = threading.Thread(target=generate)
            failed.start()
            deadline = time.monotonic() + 15
            while (health := httpx.get(f"{running.gateway.http_url}/health", timeout=5)).status_code == 200:
                assert time.monotonic() < deadline, "readiness never said the engine was stalled"
                time.sleep(0.1)
            assert health.status_code == 503 and "stalled" in health.text
            failed.join(30)
            assert codes == [grpc.StatusCode.UNAVAILABLE]
            while httpx.get(f"{running.gateway.http_url}/health", timeout=5).status_code != 200:
                assert time.monotonic() < deadline + 20, "readiness never came back"
                time.sleep(0.1)
    finally:
        running.stop()
