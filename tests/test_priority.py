"""Request priority: a step runs the first --max-batch sequences by priority (lower first, equal ones in arrival
order). A request of a lower value takes a later one's place at once, which waits with its caches and goes on with
the same tokens; on a full verifier the lowest priority gives its caches up instead; through the gateway, a client's
`priority` orders its requests, and the gateway's own work (the Batch API's requests, canary checks' plain
decoding) runs behind every client's."""

from __future__ import annotations

import json
import threading
import time

import grpc
import httpx
import pytest

from gateway_harness import ServerThread, openai_sdk, tiny_backend
from tandem.client import TandemClient
from tandem.core.config import EngineConfig, SamplingParams
from tandem.core.engine import SpeculativeEngine
from tandem.core.local import LocalDrafter, LocalVerifier
from tandem.core.runner import ModelRunner
from tandem.gateway.arms import plain_decoder
from tandem.gateway.validate import BACKGROUND_PRIORITY
from telemetry_helpers import scrape, value

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _prompt(seed: int, count: int = 30) -> list[int]:
    return [(seed * 7919 + i * 104729) % 290 + 3 for i in range(count)]


def _alone(tiny_models, prompts: list[list[int]]) -> list[list[int]]:
    target, draft, _ = tiny_models
    engine = SpeculativeEngine(LocalVerifier(ModelRunner(target.model, kv_tokens=4096)),
                               LocalDrafter(ModelRunner(draft.model, kv_tokens=4096)), EngineConfig(calibrate=False))
    return [result.token_ids for result in engine.generate(prompts, GREEDY)]


def _engine(tiny_models, kv_tokens: int, max_batch: int) -> tuple[SpeculativeEngine, ModelRunner]:
    target, draft, _ = tiny_models
    runner = ModelRunner(target.model, kv_tokens=kv_tokens)
    engine = SpeculativeEngine(LocalVerifier(runner), LocalDrafter(ModelRunner(draft.model, kv_tokens=4096)),
                               EngineConfig(calibrate=False, max_batch=max_batch))
    return engine, runner


def test_a_lower_value_takes_a_full_batchs_place_and_the_one_it_displaced_goes_on_from_its_cache(tiny_models) -> None:
    prompts = [_prompt(1), _prompt(2)]
    engine, runner = _engine(tiny_models, kv_tokens=4096, max_batch=1)
    later = engine.sequences[engine.add_request(prompts[0], GREEDY, priority=3)]
    engine.step()
    engine.step()
    held, made = later.verify_synced, len(later.output)
    assert made > 0
    first = engine.sequences[engine.add_request(prompts[1], GREEDY, priority=0)]
    while not first.finish_reason:
        engine.step()
        assert (later.verify_synced, len(later.output)) == (held, made)  # waited, its cache kept
        assert later.request_id in runner.states
    while engine.has_unfinished():
        engine.step()
    assert [engine.result(later).token_ids, engine.result(first).token_ids] == _alone(tiny_models, prompts)
    assert engine.preemptions == {"priority": 1, "kv": 0}


def test_equal_priorities_run_in_arrival_order(tiny_models) -> None:
    engine, _ = _engine(tiny_models, kv_tokens=4096, max_batch=1)
    sequences = [engine.sequences[engine.add_request(_prompt(seed), GREEDY, priority=2)] for seed in (3, 4)]
    finished = []
    while engine.has_unfinished():
        finished += [out.request_id for out in engine.step() if out.finish_reason]
    assert finished == [seq.request_id for seq in sequences]


@pytest.mark.parametrize("max_batch", [1, 4], ids=["left-out-of-the-step", "in-the-step"])
def test_on_a_full_verifier_the_lowest_priority_gives_its_caches_up_for_a_lower_value(tiny_models,
                                                                                     max_batch: int) -> None:
    """Two 40-token sequences of priority 5 hold most of a 100-token verifier (it reserves every row the longest
    row's length); one of priority 0 arrives. Whether it took the batch's one place (the others held caches outside
    the step) or joined them, the newest of priority 5 gives its caches up and it runs at once, never refused as too
    big; all end with the tokens each gets alone."""
    prompts = [_prompt(5, 40), _prompt(6, 40), _prompt(7)]
    engine, runner = _engine(tiny_models, kv_tokens=100, max_batch=max_batch)
    low = [engine.sequences[engine.add_request(p, GREEDY, priority=5)] for p in prompts[:2]]
    engine.step()
    if max_batch == 1:  # both held: the first ran, the second was admitted by running once while the first waited
        engine.sequences[low[0].request_id].priority = 6
        engine.step()
        engine.sequences[low[0].request_id].priority = 5
    assert all(seq.admitted for seq in low)
    urgent = engine.sequences[engine.add_request(prompts[2], GREEDY, priority=0)]
    engine.step()
    assert urgent.admitted and not low[1].admitted and low[0].admitted
    assert engine.preemptions["kv"] == 1
    assert runner.kv_tokens_reserved <= 100
    finished = []
    while engine.has_unfinished():
        finished += [out.request_id for out in engine.step() if out.finish_reason]
        assert runner.kv_tokens_reserved <= 100
    assert finished[0] == urgent.request_id
    assert [engine.result(seq).token_ids for seq in [*low, urgent]] == _alone(tiny_models, prompts)


@pytest.fixture(scope="module")
def one_row(tiny_models):
    """A gateway whose engine steps one sequence at a time, running batches one request at a time."""
    target, draft, _ = tiny_models
    running = ServerThread(tiny_backend(target, draft, max_batch=1), http_port=0, batch_concurrency=1, metrics_port=0)
    yield running
    running.stop()


def _chat(text: str, max_tokens: int, **extra) -> dict:
    return {"model": "tiny-target", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, **extra}


def test_what_a_clients_priority_and_service_tier_refuse(one_row) -> None:
    with TandemClient(one_row.address, timeout=30) as client, pytest.raises(grpc.RpcError) as refused:
        client.generate_text("hi", max_tokens=2, priority=-1)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "priority: must be 0 or more" in \
        refused.value.details()
    with TandemClient(one_row.address, timeout=30) as client:
        assert client.generate_text("hi", max_tokens=2, temperature=0, priority=5)  # over gRPC as over HTTP
    url = f"{one_row.gateway.http_url}/v1/chat/completions"
    for extra, param, words in (({"priority": -1}, "priority", "0 or more"),
                                ({"service_tier": "fastest"}, "service_tier", "must be one of"),
                                ({"service_tier": "flex", "priority": 3}, "priority", "cannot combine")):
        refused = httpx.post(url, json=_chat("hi", 4, **extra), timeout=30)
        assert refused.status_code == 400, extra
        assert refused.json()["error"]["param"] == param and words in refused.json()["error"]["message"]
    for tier, reported in ((None, "default"), ("auto", "default"), ("priority", "default"), ("flex", "flex")):
        answer = httpx.post(url, json=_chat("hi", 2, **({"service_tier": tier} if tier else {})), timeout=30)
        assert answer.json()["service_tier"] == reported
    response = openai_sdk(one_row).responses.create(model="tiny-target", input="hi", max_output_tokens=2,
                                                    service_tier="flex")
    assert response.service_tier == "flex"


@pytest.mark.parametrize(("behind", "ahead"), [({"priority": 1}, {}),
                                               ({"service_tier": "flex"}, {"priority": 1000})],
                         ids=["priority", "flex"])
def test_a_request_sent_later_goes_first_by_its_priority_or_tier(one_row, behind: dict, ahead: dict) -> None:
    """One sequence a step: the long request sent first waits while the short one sent after it runs."""
    url = f"{one_row.gateway.http_url}/v1/chat/completions"
    ended: dict[str, float] = {}

    def background() -> None:
        with httpx.stream("POST", url, json=_chat("a long one", 600, stream=True, **behind), timeout=60) as response:
            for _ in response.iter_lines():
                pass
        ended["behind"] = time.monotonic()

    thread = threading.Thread(target=background)
    thread.start()
    assert one_row.wait_for(lambda: any(seq.output for seq in list(one_row.engine.sequences.values())))
    urgent = httpx.post(url, json=_chat("a short one", 8, **ahead), timeout=30)
    ended["ahead"] = time.monotonic()
    thread.join(60)
    assert urgent.status_code == 200 and urgent.json()["usage"]["completion_tokens"] == 8
    assert ended["ahead"] < ended["behind"]
    assert value(scrape(one_row.gateway.metrics_url), "tandem_engine_preemptions_total", kind="priority") >= 1


def test_a_batchs_requests_run_behind_every_clients_request(one_row) -> None:
    sdk = openai_sdk(one_row)
    line = {"custom_id": "long", "method": "POST", "url": "/v1/chat/completions", "body": _chat("a long one", 600)}
    file_id = sdk.files.create(file=("b.jsonl", (json.dumps(line) + "\n").encode()), purpose="batch").id
    batch = sdk.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")

    def batch_running() -> list:
        return [seq for seq in list(one_row.engine.sequences.values()) if seq.priority >= BACKGROUND_PRIORITY]

    assert one_row.wait_for(lambda: any(seq.output for seq in batch_running()), timeout=30)
    # Even a client's least urgent request goes first: it ends while the batch's waits.
    urgent = sdk.chat.completions.create(model="tiny-target", messages=[{"role": "user", "content": "a short one"}],
                                         max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True, "priority": 2**31 - 1})
    assert urgent.usage.completion_tokens == 8
    assert batch_running() and len(batch_running()[0].output) < 600
    deadline = time.monotonic() + 60
    while sdk.batches.retrieve(batch.id).status != "completed":
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_canary_checks_plain_decoding_waits_behind_a_clients_request(one_row) -> None:
    url = f"{one_row.gateway.http_url}/v1/chat/completions"
    client = threading.Thread(target=httpx.post, args=(url,), kwargs={"json": _chat("a long one", 600), "timeout": 60})
    client.start()
    assert one_row.wait_for(lambda: any(seq.output for seq in list(one_row.engine.sequences.values())))
    checked: list[list[int]] = []
    check = threading.Thread(target=lambda: checked.append(plain_decoder(one_row.gateway.loop,
                                                                         one_row.event_loop)([5, 6, 7], 8)))
    check.start()

    def waiting_check() -> list:
        return [seq for seq in list(one_row.engine.sequences.values()) if seq.request_id.startswith("plain-check-")]

    assert one_row.wait_for(lambda: bool(waiting_check()))
    assert waiting_check()[0].priority >= BACKGROUND_PRIORITY and not waiting_check()[0].output
    client.join(60)
    check.join(60)
    assert len(checked[0]) == 8


def test_a_keys_priority_puts_its_tenants_requests_behind_other_tenants(tiny_models, tmp_path) -> None:
    from tandem.errors import InvalidArgument
    from tandem.gateway.auth import ApiKeys, create_key

    path = tmp_path / "keys.jsonl"
    free, paid = create_key(path, "free", priority=10), create_key(path, "paid")
    assert ApiKeys.load(path).tenants["free"].priority == 10 and ApiKeys.load(path).tenants["paid"].priority == 0
    (tmp_path / "bad.jsonl").write_text(json.dumps({"sha256": "0" * 64, "tenant": "t", "priority": -1}) + "\n")
    with pytest.raises(InvalidArgument, match="line 1: priority: must be an integer from 0"):
        ApiKeys.load(tmp_path / "bad.jsonl")
    target, draft, _ = tiny_models
    gateway = ServerThread(tiny_backend(target, draft, max_batch=1), http_port=0, api_keys=ApiKeys.load(path))
    try:
        url = f"{gateway.gateway.http_url}/v1/chat/completions"
        ended: dict[str, float] = {}

        def free_tier() -> None:
            with httpx.stream("POST", url, json=_chat("a long one", 600, stream=True), timeout=60,
                              headers={"authorization": f"Bearer {free}"}) as response:
                for _ in response.iter_lines():
                    pass
            ended["free"] = time.monotonic()

        thread = threading.Thread(target=free_tier)
        thread.start()
        assert gateway.wait_for(lambda: any(seq.priority == 10 and seq.output
                                            for seq in list(gateway.engine.sequences.values())))
        answer = httpx.post(url, json=_chat("a short one", 8), headers={"authorization": f"Bearer {paid}"},
                            timeout=30)
        ended["paid"] = time.monotonic()
        thread.join(60)
        assert answer.status_code == 200 and ended["paid"] < ended["free"]
    finally:
        gateway.stop()
