"""Engine lanes: a gateway's requests over several engines on the same drafter and verifier, so one lane's rows
draft while another lane's rows verify. Each side here is "one device": its calls run one at a time (as they would
on one GPU) and each call's interval is recorded, so overlap is observed, not inferred from timings."""

from __future__ import annotations

import threading
import time

import pytest

from gateway_harness import ServerThread
from tandem.client import TandemClient
from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.core.local import LocalDrafter, LocalVerifier
from tandem.engines import Backend, engine_lanes
from tandem.engines.local import build_engine
from tandem.gateway.lanes import LanedLoop

PROMPTS = [[5, 6, 7, 8], [40, 50, 60], [1, 2, 3, 4, 5, 6, 7], [200, 17, 33], [9, 9, 9], [120, 121, 122, 123]]
TOKENS = 24
DEVICE_SECONDS = 0.004  # each call also holds its device this long, so calls of two lanes surely meet


class Device:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[str, float, float]] = []  # (engine thread, start, end)

    def run(self, call):
        with self.lock:
            started = time.perf_counter()
            result = call()
            time.sleep(DEVICE_SECONDS)
            self.calls.append((threading.current_thread().name, started, time.perf_counter()))
        return result


class DraftDevice(LocalDrafter):
    def __init__(self, inner: LocalDrafter) -> None:
        super().__init__(inner.runner, inner.top_m, inner.confidence)
        self.device = Device()

    def propose(self, requests):
        return self.device.run(lambda: super(DraftDevice, self).propose(requests))

    def release(self, seq_id: str, retain: bool = False) -> None:
        self.device.run(lambda: super(DraftDevice, self).release(seq_id, retain))


class VerifyDevice(LocalVerifier):
    def __init__(self, inner: LocalVerifier) -> None:
        super().__init__(inner.runner)
        self.device = Device()

    def verify(self, requests):
        return self.device.run(lambda: super(VerifyDevice, self).verify(requests))

    def release(self, seq_id: str, retain: bool = False) -> None:
        self.device.run(lambda: super(VerifyDevice, self).release(seq_id, retain))


@pytest.fixture()
def served(tiny_models, request):
    """A gateway with `request.param` lanes over one drafter device and one verifier device (tiny models)."""
    target, draft, _ = tiny_models
    config = EngineConfig(spec=SpecConfig(adaptive=False, k_init=3), calibrate=False, max_batch=3)
    plain = build_engine(target, draft, config)
    drafter, verifier = DraftDevice(plain.drafter), VerifyDevice(plain.verifier)
    engines = engine_lanes(lambda lane: (verifier, drafter), request.param, config, plain.eos_token_ids, plain.decode)
    server = ServerThread(lambda: Backend(engines[0], target.tokenizer, "tiny-target", "tiny-draft",
                                          lanes=tuple(engines[1:])))
    yield server, drafter.device, verifier.device
    server.stop()


@pytest.fixture(scope="module")
def expected(tiny_models):
    greedy = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    return [r.token_ids for r in build_engine(tiny_models[0], None).generate(PROMPTS, greedy)]


def _all_at_once(address: str) -> list[list[int]]:
    out: dict[int, list[int]] = {}

    def one(index: int) -> None:
        with TandemClient(address, timeout=60) as client:
            out[index] = [t for item in client.generate(token_ids=PROMPTS[index], temperature=0.0, max_tokens=TOKENS,
                                                         ignore_eos=True) for t in getattr(item, "token_ids", [])]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return [out.get(i) for i in range(len(PROMPTS))]


def _overlaps(drafts: list, verifies: list) -> int:
    """Draft calls that ran while a verify call of another engine lane ran."""
    return sum(1 for lane, start, end in drafts
               if any(other != lane and max(start, s) < min(end, e) for other, s, e in verifies))


@pytest.mark.parametrize("served", [2], indirect=True)
def test_two_lanes_draft_while_the_other_verifies_and_stay_exact(served, expected) -> None:
    server, drafts, verifies = served
    assert isinstance(server.gateway.loop, LanedLoop)
    assert _all_at_once(server.address) == expected
    lanes = {lane for lane, _, _ in verifies.calls}
    assert lanes == {"tandem-engine-0", "tandem-engine-1"}, "requests should spread over both lanes"
    assert _overlaps(drafts.calls, verifies.calls) > 0
    assert server.wait_for(lambda: server.gateway.loop.active == 0)


@pytest.mark.parametrize("served", [2], indirect=True)
def test_a_second_lane_takes_requests_only_once_the_first_lanes_batch_is_full(served, expected) -> None:
    server, _, verifies = served
    with TandemClient(server.address, timeout=60) as client:
        for index in (0, 1):  # one at a time: the first lane (batch 3) always has room
            ids = [t for item in client.generate(token_ids=PROMPTS[index], temperature=0.0, max_tokens=TOKENS,
                                                  ignore_eos=True) for t in getattr(item, "token_ids", [])]
            assert ids == expected[index]
    assert {lane for lane, _, _ in verifies.calls} == {"tandem-engine-0"}


@pytest.mark.parametrize("served", [1], indirect=True)
def test_one_lane_runs_its_rounds_in_order(served, expected) -> None:
    server, drafts, verifies = served
    assert _all_at_once(server.address) == expected
    assert _overlaps(drafts.calls, verifies.calls) == 0
    assert not any(s < e0 and s0 < e for _, s, e in drafts.calls for _, s0, e0 in verifies.calls)


@pytest.mark.parametrize("served", [2], indirect=True)
def test_lanes_share_request_ids_and_cancel_across_lanes(served) -> None:
    server, _, _ = served
    with TandemClient(server.address, timeout=60) as client:
        stream = client.generate(token_ids=PROMPTS[0], temperature=0.0, max_tokens=400, ignore_eos=True,
                                 request_id="same")
        next(iter(stream))
        with pytest.raises(Exception, match="already running"):
            list(client.generate(token_ids=PROMPTS[1], temperature=0.0, max_tokens=4, request_id="same"))
        assert client.abort("same")
    assert server.wait_for(lambda: server.gateway.loop.active == 0, timeout=30)
