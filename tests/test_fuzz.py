"""Hostile requests at a real gateway over the tiny models: an engine failure's text never reaches a client, and a
thousand random gRPC requests (wild values, random bytes, four clients at once) get OK or a client error, never an
internal one, and leave the gateway serving with its caches empty."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway_harness import ServerThread
from hardening_harness import generation_stub, named_loader, status_of
from tandem.gateway.server import READINESS_SERVICE
from tandem.gateway.validate import CHAT_ROLES, GatewayLimits
from tandem.v1 import generation_pb2 as pb

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def test_engine_failures_do_not_leak_their_text(tiny_models) -> None:
    target, draft, _ = tiny_models

    def fault(engine) -> None:
        if any(seq.prompt[0] == 255 for seq in engine.sequences.values()):
            raise RuntimeError("/srv/secret/weights/model.safetensors: corrupt block at 0x1f")

    running = ServerThread(named_loader(target, draft, "tiny-target", "tiny-draft", fault), http_port=0)
    try:
        with grpc.insecure_channel(running.address) as channel:
            code, details = status_of(lambda: generation_stub(channel).Generate(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=[255, 1]), sampling=pb.SamplingParams(max_tokens=4)), timeout=30))
        assert code == grpc.StatusCode.INTERNAL and details.startswith("engine step failed")
        assert "/srv" not in details and "corrupt" not in details
        response = httpx.post(f"{running.gateway.http_url}/v1/completions", timeout=30,
                              json={"prompt": [255, 1], "max_tokens": 4})
        assert response.status_code == 500 and "/srv" not in response.text and "corrupt" not in response.text
    finally:
        running.stop()


FUZZ_REQUESTS = 1000
ALLOWED = {grpc.StatusCode.OK, INVALID, grpc.StatusCode.RESOURCE_EXHAUSTED}


class _Fuzz:
    """Random requests: each value wild (out of range, hostile) with probability `wild`, else plausible, so that
    both the refusals and the generate path (n, logprobs, stops, seeds, sessions) get exercised."""

    I32 = (-(2**31), 2**31 - 1)
    TEXTS = ("abc xyz\n\t", "<|im_end|><|im_start|><|endoftext|>", "\x00\x01\x7f\u200b\ufeff", "éß中文🙂\U0010ffff")

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.wild = 0.0

    def odd(self) -> bool:
        return self.rng.random() < self.wild

    def text(self, longest: int, pools: tuple[str, ...] = TEXTS) -> str:
        rng, out = self.rng, []
        for _ in range(rng.randint(0, longest)):
            if self.odd():
                out.append(chr(rng.choice([rng.randint(0, 0xD7FF), rng.randint(0xE000, 0x10FFFF)])))
            else:
                out.append(rng.choice(rng.choice(pools)))
        return "".join(out)

    def int(self, typical: tuple[int, int], low: int = I32[0], high: int = I32[1]) -> int:
        rng = self.rng
        return rng.choice([low, high, -1, rng.randint(low, high)]) if self.odd() else rng.randint(*typical)

    def float(self, typical: tuple[float, float]) -> float:
        if self.odd():
            return self.rng.choice([-1.0, 1e30, -1e30, float("nan"), float("inf"), -float("inf"), 1e-40, 0.0])
        return self.rng.uniform(*typical)

    def request(self) -> pb.GenerateRequest:
        rng = self.rng
        self.wild = rng.choice([0.0, 0.0, 0.01, 0.05, 0.5])
        ids = ("abcdefgh-_:/",)
        request = pb.GenerateRequest()
        if rng.random() < 0.5:
            request.request_id = self.text(200 if self.odd() else 30, self.TEXTS if self.odd() else ids)
        if rng.random() < 0.3:
            request.session_id = self.text(200 if self.odd() else 30, self.TEXTS if self.odd() else ids)
        kind = rng.choice(["prompt", "token_ids", "chat", "prompt", "token_ids", "chat", None])
        if kind == "prompt":
            request.prompt = self.text(60)
        elif kind == "token_ids":
            request.token_ids.ids.extend(self.int((0, 319)) for _ in range(rng.randint(0 if self.odd() else 1, 40)))
        elif kind == "chat":
            request.chat.SetInParent()
            for _ in range(rng.randint(0 if self.odd() else 1, 4)):
                role = rng.choice(["", "robot", self.text(8)]) if self.odd() else rng.choice(CHAT_ROLES)
                request.chat.messages.add(role=role, content=self.text(40))
        if rng.random() < 0.97:
            sampling = request.sampling
            sampling.SetInParent()
            if rng.random() < 0.6:
                sampling.temperature = self.float((0.0, 2.0))
            if rng.random() < 0.3:
                sampling.top_p = self.float((0.05, 1.0))
            if rng.random() < 0.3:
                sampling.top_k = self.int((0, 50))
            if rng.random() < 0.3:
                sampling.seed = rng.choice([2**63, 2**64 - 1, rng.randint(0, 2**64 - 1)]) if self.odd() \
                    else rng.randint(0, 2**63 - 1)
            if rng.random() < 0.97:
                sampling.max_tokens = self.int((1, 6))
        for _ in range(rng.choice([17, 40]) if self.odd() else rng.choice([0, 0, 1, 3])):
            request.stop.append(self.text(rng.choice([0, 300]) if self.odd() else 4) or "x")
        for _ in range(rng.choice([65, 100]) if self.odd() else rng.choice([0, 0, 1, 5])):
            request.stop_token_ids.append(self.int((0, 319)))
        if rng.random() < 0.5:
            request.speculation.mode = rng.choice([3, -1, 2**31 - 1]) if self.odd() else rng.choice([0, 1, 2])
            if rng.random() < 0.5:
                request.speculation.max_k = self.int((0, 4))
        request.ignore_eos = rng.random() < 0.5
        if rng.random() < 0.4:
            request.n = self.int((0, 4))
        if rng.random() < 0.4:
            request.logprobs = self.int((0, 20))
        return request


def test_fuzzed_requests_never_fail_internally(tiny_models) -> None:
    target, draft, _ = tiny_models
    running = ServerThread(named_loader(target, draft, "tiny-target", "tiny-draft"), max_requests=64,
                           limits=GatewayLimits(max_tokens=6, max_prompt_tokens=512, max_choices=4))
    rng = random.Random(20261124)
    fuzz = _Fuzz(rng)
    wrong: list[str] = []
    codes: dict[str, int] = {}
    started = time.monotonic()
    try:
        with grpc.insecure_channel(running.address) as channel:
            stub = generation_stub(channel)
            raw = channel.unary_stream("/tandem.v1.GenerationService/Generate")
            # Now and then random bytes as the message itself; four clients at once (the engine batches them).
            requests = [rng.randbytes(rng.randint(0, 200)) if index % 50 == 49 else fuzz.request()
                        for index in range(FUZZ_REQUESTS)]

            def send(request: pb.GenerateRequest | bytes) -> tuple[grpc.StatusCode, str]:
                call = raw if isinstance(request, bytes) else stub.Generate
                return status_of(lambda: call(request, timeout=30))

            with ThreadPoolExecutor(4) as pool:
                for request, (code, details) in zip(requests, pool.map(send, requests), strict=True):
                    codes[code.name] = codes.get(code.name, 0) + 1
                    if code not in ALLOWED:
                        wrong.append(f"{code.name}: {details} <- {request!r:.300}")
            health = health_pb2_grpc.HealthStub(channel)
            status = health.Check(health_pb2.HealthCheckRequest(service=READINESS_SERVICE), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
            after = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), ignore_eos=True,
                                                          sampling=pb.SamplingParams(temperature=0.0, max_tokens=4)),
                                       timeout=30))
            assert after[-1].complete.usage.completion_tokens == 4
        assert running.wait_for(running.caches_empty, timeout=30)
    finally:
        running.stop()
    print(f"\nfuzz: {FUZZ_REQUESTS} requests in {time.monotonic() - started:.1f} s: {codes}")
    assert not wrong, "\n".join(wrong[:10])
