"""Target replicas as real Ray actors beside draft workers: deadlines that grow with a call's tokens and a pool's
pace, chunked prefill, KV usage summed over a pool, formats, a refused row failing its own caller alone, and rounds
that survive a killed replica or wait for the only one's restart."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

ray = pytest.importorskip("ray")

from ray_workers_harness import (  # noqa: E402 (the fixtures by their names: ray_cluster, pool, replicas, expected)
    FORMATTED,
    GREEDY,
    PROMPTS,
    _answering,
    _eventually,
    _plain,
    expected_fixture,  # noqa: F401
    pool_fixture,  # noqa: F401
    ray_cluster_fixture,  # noqa: F401
    replicas_fixture,  # noqa: F401
)
from tandem.core.config import EngineConfig, OutputFormat, SamplingParams, SpecConfig  # noqa: E402
from tandem.core.engine import SpeculativeEngine  # noqa: E402
from tandem.core.protocol import KVUsage, VerifyRequest  # noqa: E402
from tandem.core.row_layout import RowLayout  # noqa: E402
from tandem.engines.local import build_engine  # noqa: E402
from tandem.errors import RequestRefused  # noqa: E402
from tandem.workers.draft_pool import RayDrafter  # noqa: E402
from tandem.workers.target_pool import RayVerifier  # noqa: E402


def test_a_slow_target_replica_keeps_its_rows_and_a_hung_one_is_benched(ray_cluster) -> None:
    """The target's deadline grows with the tokens a call carries: a replica that takes its time over a long prefill
    (16 prompts in bf16 on one AVX2 core: minutes) is slow, not hung. A fixed deadline benched the only replica
    during `tandem serve`'s calibration and the server exited."""
    from tandem.core.protocol import VerifyRequest, VerifyResult
    from tandem.workers.pace import MARGIN
    from tandem.workers.target_pool import TargetUnavailable
    from tandem.workers.worker_base import WorkerReply

    @ray_cluster.remote(num_cpus=0)
    class SlowReplica:
        """Takes `per_token_s` a token of the call, or forever once told to hang."""

        def __init__(self, per_token_s: float) -> None:
            self.per_token_s, self.hung = per_token_s, False

        def info(self) -> dict:
            return {"vocab_size": 320, "context_window": 4096}

        def hang(self) -> None:
            self.hung = True

        def slow_down(self, factor: float) -> None:
            self.per_token_s *= factor

        def verify(self, requests: list[VerifyRequest]) -> WorkerReply:
            tokens = sum(len(r.append) + (len(r.draft.tokens) if r.draft else 0) for r in requests)
            time.sleep(3600 if self.hung else self.per_token_s * tokens)
            return WorkerReply(results=[VerifyResult(accepted=0, next_token=7) for _ in requests])

    replica = SlowReplica.remote(0.02)
    prefill = [VerifyRequest(f"slow-{i}", 0, list(range(1, 41)), None, GREEDY) for i in range(2)]  # 80 tokens: 1.6 s
    started = time.monotonic()
    assert RayVerifier([replica], timeout_s=0.5, per_token_s=0.05).verify(prefill) == [VerifyResult(0, 7)] * 2
    assert time.monotonic() - started > 1.5  # longer than the base deadline: it waited for the tokens' share
    fixed = RayVerifier([replica], timeout_s=0.5, per_token_s=0.0, cooldown_s=30)  # the deadline as it was
    with pytest.raises(TargetUnavailable):
        fixed.verify(prefill)
    assert not fixed.router.healthy(0)
    # A pace learned from answered calls tightens the allowance per token; a replica at twice that pace still answers.
    paced = RayVerifier([replica], timeout_s=0.5, per_token_s=1.0, cooldown_s=30)
    paced.verify(prefill)
    assert 0.02 <= paced.pace.per_token < 0.05 and paced.deadline_s(prefill) < 0.5 + 80 * 0.2
    ray.get(replica.slow_down.remote(2.0))
    assert paced.verify(prefill) == [VerifyResult(0, 7)] * 2 and paced.router.healthy(0)
    hung = RayVerifier([replica], timeout_s=0.5, per_token_s=0.05, cooldown_s=30)  # (asks the replica's info)
    ray.get(replica.hang.remote())
    started = time.monotonic()
    with pytest.raises(TargetUnavailable):
        hung.verify([VerifyRequest("hung", 0, [1, 2, 3, 4], None, GREEDY)])
    assert time.monotonic() - started < 5 and not hung.router.healthy(0)
    long_prompt = [VerifyRequest("hung", 0, list(range(1, 101)), None, GREEDY)]  # fixed allowance: 100.5 s
    started = time.monotonic()
    with pytest.raises(TargetUnavailable):
        paced.verify(long_prompt)
    assert time.monotonic() - started < 0.5 + 100 * MARGIN * 0.05 and not paced.router.healthy(0)
    ray.kill(replica)


def test_a_pools_pace_is_the_slowest_recent_one_over_calls_with_many_tokens() -> None:
    from tandem.workers.pace import DECAY, MARGIN, MIN_TOKENS, Pace

    pace = Pace(len)
    assert pace.allowance(0.5) == 0.5  # nothing learned: the fixed allowance
    pace.observe(3.0, ["x"] * (MIN_TOKENS - 1))  # a few tokens: mostly fixed costs, no pace
    assert pace.per_token == 0.0
    pace.observe(1.6, ["x"] * 80)
    assert pace.per_token == 0.02 and pace.allowance(0.5) == MARGIN * 0.02
    pace.observe(0.8, ["x"] * 80)  # faster: the slower pace decays rather than drops
    assert pace.per_token == 0.02 * DECAY
    pace.observe(8.0, ["x"] * 80)  # slower: taken at once, and never above the fixed allowance
    assert pace.per_token == 0.1 and pace.allowance(0.3) == 0.3


def test_target_replicas_prefill_a_newcomer_in_chunks_while_another_decodes(tiny_models, pool, replicas,
                                                                          expected) -> None:
    local = build_engine(tiny_models[0], None, EngineConfig(calibrate=False))
    config = EngineConfig(spec=SpecConfig(adaptive=False, k_init=3), calibrate=False, prefill_chunk=2)
    engine = SpeculativeEngine(RayVerifier(replicas), RayDrafter(pool), config, local.eos_token_ids, local.decode)
    # The batch plan prices rounds as the replicas' runners lay out rows: the layout comes from the workers.
    assert engine.costs.layout == local.verifier.row_layout == RowLayout("cpu", can_pack=True)
    decoding = engine.sequences[engine.add_request(PROMPTS[0], GREEDY)]
    engine.step()
    newcomer = engine.sequences[engine.add_request(PROMPTS[2], GREEDY)]
    for _ in range(3):  # 8 tokens to cache before its first round: 2 per step while the other decodes
        engine.step()
        assert not newcomer.output
    engine.step()
    assert newcomer.output
    while engine.has_unfinished():
        engine.step()
    assert [decoding.output, newcomer.output] == [expected[0], expected[2]]


def _steady_infos(ray_pool, workers: list, within_s: float = 10.0) -> tuple[KVUsage, list[dict]]:
    """The pool's KV usage and its workers' infos, read while neither changed: a pool sends releases without waiting
    for them, and a release moves a session's cache to the retained ones while the reads run."""
    deadline = time.monotonic() + within_s
    while True:
        before = ray.get([w.info.remote() for w in workers])
        usage = ray_pool.kv_usage()
        infos = ray.get([w.info.remote() for w in workers])
        if [KVUsage.from_info(i) for i in before] == [KVUsage.from_info(i) for i in infos]:
            return usage, infos
        assert time.monotonic() < deadline, "the workers' KV usage kept changing"
        time.sleep(0.05)


def test_pools_report_kv_usage_summed_over_their_workers_leaving_out_a_stalled_one(tiny_models, pool,
                                                                                 replicas) -> None:
    local = build_engine(tiny_models[0], None, EngineConfig(calibrate=False))
    verifier, drafter = RayVerifier(replicas), RayDrafter(pool)
    engine = SpeculativeEngine(verifier, drafter, EngineConfig(spec=SpecConfig(adaptive=False, k_init=3),
                                                               calibrate=False), local.eos_token_ids, local.decode)
    for i, prompt in enumerate(PROMPTS):  # sessions: their caches stay on the workers after the requests
        engine.add_request(prompt, GREEDY, session_id=f"kv-usage-{i}")
    while engine.has_unfinished():
        engine.step()
    for ray_pool, workers in ((verifier, replicas), (drafter, pool)):
        usage, infos = _steady_infos(ray_pool, workers)
        assert usage == sum((KVUsage.from_info(info) for info in infos), KVUsage())
        assert 0 < usage.used <= usage.reserved <= usage.capacity
        assert usage.capacity == sum(info["kv_tokens_capacity"] for info in infos) > infos[0]["kv_tokens_capacity"]
    # A worker that does not answer in time (stopped here; dead or busy alike) is left out.
    os.kill(infos[0]["pid"], signal.SIGSTOP)
    try:
        started = time.monotonic()
        assert drafter.kv_usage(timeout_s=0.5) == KVUsage.from_info(infos[1])
        assert time.monotonic() - started < 5
    finally:
        os.kill(infos[0]["pid"], signal.SIGCONT)


def test_target_replicas_follow_a_format(tiny_models, pool, replicas) -> None:
    """Formatted rows through target replicas and draft workers both: plain decoding's tokens."""
    local = build_engine(tiny_models[0], None, EngineConfig(calibrate=False))
    engine = SpeculativeEngine(RayVerifier(replicas), RayDrafter(pool), EngineConfig(
        spec=SpecConfig(adaptive=False, k_init=3), calibrate=False), local.eos_token_ids, local.decode)
    results = engine.generate(PROMPTS, FORMATTED)
    assert [r.token_ids for r in results] == _plain(tiny_models, FORMATTED)
    assert sum(r.stats["accepted"] for r in results) > 0


def test_a_refused_row_fails_its_own_caller_and_a_call_merged_with_it_is_answered(tiny_models, replicas) -> None:
    """Two gateways' clients on one replica. A row whose format costs too much to follow is refused, by its own id,
    to its caller alone: a call the worker merged into the same forward is rerun and answered, and the replica stays
    in service."""
    tokenizer = tiny_models[0].tokenizer
    (a,) = tokenizer.encode("a", add_special_tokens=False)
    slow = SamplingParams(temperature=0.0, max_tokens=400, output_format=OutputFormat(
        "grammar", 'start: e "!"\ne: e e | e e e | "a"'))  # ambiguous: each "a" costs more to parse
    gateways = [RayVerifier([replicas[0]], prefix=f"gw{i}-") for i in range(3)]  # a client is one gateway's

    def formatted(seq_id: str, length: int) -> VerifyRequest:  # an output of `length` "a"s, sent whole
        return VerifyRequest(seq_id, 0, [7] + [a] * length, None, slow, output_start=1)

    outcomes: dict[str, object] = {}
    merged = ray.get(replicas[0].info.remote())["merged_forwards"]

    def call(name: str, client: RayVerifier, request: VerifyRequest) -> None:
        try:
            outcomes[name] = client.verify([request])
        except RequestRefused as refused:
            outcomes[name] = refused

    blocker = threading.Thread(target=call, args=("blocker", gateways[1], formatted("blocker", 300)))
    blocker.start()
    time.sleep(0.3)  # the blocker's forward is running: the next two calls queue behind it and merge
    plain = VerifyRequest("plain", 0, PROMPTS[0], None, GREEDY)
    pair = [threading.Thread(target=call, args=("plain", gateways[0], plain)),
            threading.Thread(target=call, args=("refused", gateways[2], formatted("refused", 240)))]
    for thread in pair:
        thread.start()
    for thread in [blocker, *pair]:
        thread.join(timeout=120)
    assert isinstance(outcomes["blocker"], RequestRefused) and outcomes["blocker"].request_id == "blocker"
    assert isinstance(outcomes["refused"], RequestRefused) and outcomes["refused"].request_id == "refused"
    assert str(outcomes["refused"]).startswith("response_format: ")
    plain_result = outcomes["plain"]
    assert isinstance(plain_result, list) and plain_result[0].next_token is not None
    assert all(client.router.healthy(0) for client in gateways)
    assert ray.get(replicas[0].info.remote())["merged_forwards"] == merged + 1  # the plain and the refused call
    for client, seq_id in zip(gateways, ("plain", "blocker", "refused"), strict=True):
        client.release(seq_id)
    assert _eventually(lambda: ray.get(replicas[0].cached_sequences.remote()) == 0)


def test_target_replicas_batch_and_survive_a_killed_replica(tiny_models, pool, replicas, expected) -> None:
    local = build_engine(tiny_models[0], None, EngineConfig(calibrate=False))
    verifier = RayVerifier(replicas, cooldown_s=0.5)
    engine = SpeculativeEngine(verifier, RayDrafter(pool), EngineConfig(spec=SpecConfig(adaptive=False, k_init=3),
                                                                         calibrate=False),
                               local.eos_token_ids, local.decode)
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    assert len(set(verifier.router.affinity.values()) | {0}) >= 1
    for _ in range(3):
        engine.step()
    assert set(verifier.router.affinity.values()) == {0, 1}, "sessions should spread over both replicas"
    victim = replicas[verifier.router.affinity[ids[0]]]
    os.kill(ray.get(victim.info.remote())["pid"], signal.SIGKILL)
    seqs = [engine.sequences[i] for i in ids]
    while engine.has_unfinished():
        engine.step()
    assert [s.output for s in seqs] == expected
    assert _eventually(lambda: ray.get([r.cached_sequences.remote() for r in replicas if r is not victim]) == [0])


def test_the_only_target_replica_killed_its_rounds_wait_for_the_restart(tiny_models, pool, replicas, expected) -> None:
    """The default deployment, one single-rank replica: its death failed every request at once (UNAVAILABLE), where
    a tensor-parallel one's rounds waited for its rebuild. Ray restarts it; the rounds wait and resend histories."""
    _answering(replicas)
    local = build_engine(tiny_models[0], None, EngineConfig(calibrate=False))
    verifier = RayVerifier(replicas[:1], cooldown_s=30.0)  # no cool-down ends within the test: the probe brings it
    engine = SpeculativeEngine(verifier, RayDrafter(pool), EngineConfig(spec=SpecConfig(adaptive=False, k_init=3),
                                                                         calibrate=False),
                               local.eos_token_ids, local.decode)
    seqs = [engine.sequences[engine.add_request(p, GREEDY)] for p in PROMPTS]
    for _ in range(3):
        engine.step()
    os.kill(ray.get(replicas[0].info.remote())["pid"], signal.SIGKILL)
    while engine.has_unfinished():
        engine.step()
    assert [s.output for s in seqs] == expected
    _answering(replicas)
