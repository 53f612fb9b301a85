"""Draft workers and target replicas as real Ray actors: exact output, and isolation when a worker dies or stalls."""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import threading
import time

import pytest

ray = pytest.importorskip("ray")

from tandem.core.config import EngineConfig, OutputFormat, SamplingParams, SpecConfig  # noqa: E402
from tandem.core.engine import SpeculativeEngine  # noqa: E402
from tandem.core.protocol import KVUsage, VerifyRequest  # noqa: E402
from tandem.core.row_layout import RowLayout  # noqa: E402
from tandem.engines.local import build_engine  # noqa: E402
from tandem.errors import RequestRefused  # noqa: E402
from tandem.workers.draft_pool import RayDrafter, start_draft_workers  # noqa: E402
from tandem.workers.target_pool import RayVerifier, start_target_replicas  # noqa: E402
from tandem.workers.worker_base import WorkerConfig  # noqa: E402
from test_logprobs import _assert_matches  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
SEEDED = [SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=24, ignore_eos=True) for s in range(4)]
PROMPTS = [[72, 101, 108, 108, 111], [40, 50, 60], [1, 2, 3, 4, 5, 6, 7, 8, 9], [200, 17]]


def test_the_in_process_ray_modules_share_one_xdist_group(request) -> None:
    """tests/conftest.py puts the modules that use the session's in-process Ray in one xdist group, so one worker
    starts it once. Two things spread them over every worker, silently: marks added after xdist's own hook has read
    them, and pytest 9.2, which no longer reads the node id xdist marks (pytest-dev/pytest-xdist#1386)."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not under pytest-xdist's --dist loadgroup")
    assert request.node.nodeid.endswith("@ray")


@pytest.fixture(scope="module")
def ray_cluster(ray_session):
    return ray_session


def _actors(start, model_dir):
    """Two actors on a tiny model for the module, killed afterwards so later modules have the CPUs."""
    workers = start(WorkerConfig(model=str(model_dir), dtype="float32", threads=1), count=2)
    yield workers
    for worker in workers:
        ray.kill(worker)


@pytest.fixture(scope="module")
def pool(ray_cluster, tiny_dirs):
    yield from _actors(start_draft_workers, tiny_dirs.draft)


def _engine(tiny_models, workers, **pool_options) -> SpeculativeEngine:
    local = build_engine(tiny_models[0], None, EngineConfig(calibrate=False))
    drafter = RayDrafter(workers, **pool_options)
    return SpeculativeEngine(local.verifier, drafter, EngineConfig(spec=SpecConfig(adaptive=False, k_init=4),
                                                                   calibrate=False),
                             local.eos_token_ids, local.decode)


@pytest.fixture(scope="module")
def expected(tiny_models):
    return [r.token_ids for r in build_engine(tiny_models[0], None).generate(PROMPTS, GREEDY)]


def test_pooled_drafting_is_exact_and_spreads_sessions(tiny_models, pool, expected) -> None:
    engine = _engine(tiny_models, pool)
    results = engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats["accepted"] for r in results) > 0
    assert not engine.drafter.affinity
    assert _eventually(lambda: ray.get([w.cached_sequences.remote() for w in pool]) == [0, 0])


def _eventually(condition, timeout_s: float = 10.0) -> bool:
    """Releases are fire-and-forget calls that a worker's threads may run after a later call: poll for them."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _plain(tiny_models, params: list[SamplingParams]) -> list[list[int]]:
    return [r.token_ids for r in build_engine(tiny_models[0], None, EngineConfig(calibrate=False))
            .generate(PROMPTS, params)]


def test_pooled_sampled_drafting_matches_in_process(tiny_models, pool) -> None:
    """Seeded: the tokens plain decoding gives. Unseeded: the engine's seed keys the numbers, so the same engine_seed
    gives the in-process engine's tokens."""
    assert [r.token_ids for r in _engine(tiny_models, pool).generate(PROMPTS, SEEDED)] == _plain(tiny_models, SEEDED)
    unseeded = [SamplingParams(temperature=0.8, engine_seed=100 + i, max_tokens=24, ignore_eos=True)
                for i in range(len(PROMPTS))]
    in_process = build_engine(tiny_models[0], tiny_models[1],
                              EngineConfig(spec=SpecConfig(adaptive=False, k_init=4), calibrate=False))
    results = _engine(tiny_models, pool).generate(PROMPTS, unseeded)
    assert [r.token_ids for r in results] == [r.token_ids for r in in_process.generate(PROMPTS, unseeded)]
    assert sum(r.stats["accepted"] for r in results) > 0


def _pooled_as_in_process(tiny_models, pool, params: list[SamplingParams]) -> list:
    """Pooled drafting's results, checked against plain decoding's tokens and in-process drafting's acceptance."""
    results = _engine(tiny_models, pool).generate(PROMPTS, params)
    assert [r.token_ids for r in results] == _plain(tiny_models, params)
    in_process = build_engine(tiny_models[0], tiny_models[1],
                              EngineConfig(spec=SpecConfig(adaptive=False, k_init=4), calibrate=False))
    local = in_process.generate(PROMPTS, params)
    assert [r.stats["accepted"] for r in results] == [r.stats["accepted"] for r in local]
    return results


def test_pooled_drafting_under_penalties_matches_in_process(tiny_models, pool) -> None:
    """Penalties and a bias reach the draft workers with where each request's output begins: greedy and seeded rows
    give plain decoding's tokens, and the workers' drafts are accepted exactly as often as in-process ones."""
    shaped = {"repetition_penalty": 1.3, "frequency_penalty": 0.8, "presence_penalty": 0.4, "logit_bias": ((5, 2.0),)}
    _pooled_as_in_process(tiny_models, pool, [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **shaped),
        SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True, **shaped)] * 2)


FORMAT_REGEX = "[a-f]{3}( [0-9]{2}){1,4}"
FORMATTED = [SamplingParams(temperature=0.0, max_tokens=24, output_format=OutputFormat("regex", FORMAT_REGEX)),
             SamplingParams(temperature=0.8, seed=7, max_tokens=24,
                            output_format=OutputFormat("regex", FORMAT_REGEX))] * 2


def test_pooled_drafting_under_a_format_matches_in_process(tiny_models, pool) -> None:
    """A response format reaches the draft workers, which mask their drafts by it: greedy and seeded rows give plain
    decoding's tokens, and the workers' drafts are accepted exactly as often as in-process ones."""
    results = _pooled_as_in_process(tiny_models, pool, FORMATTED)
    assert sum(r.stats["accepted"] for r in results) > 0
    decode = tiny_models[0].tokenizer.decode
    assert all(re.fullmatch(FORMAT_REGEX, decode(r.token_ids, skip_special_tokens=True)) for r in results)


def _worker_of(engine: SpeculativeEngine, request_id: str):
    return engine.drafter.workers[engine.drafter.affinity[request_id]]


def test_killed_worker_mid_stream_keeps_output_identical(tiny_models, pool, expected) -> None:
    engine = _engine(tiny_models, pool, cooldown_s=0.5)
    request_id = engine.add_request(PROMPTS[0], GREEDY)
    for _ in range(3):
        engine.step()
    victim = _worker_of(engine, request_id)
    os.kill(ray.get(victim.info.remote())["pid"], signal.SIGKILL)
    seq = engine.sequences[request_id]
    while engine.has_unfinished():
        engine.step()
    assert seq.output == expected[0]
    assert engine.drafter.stats.failures >= 1 and seq.stats.draft_failures >= 1
    # Ray restarts the actor; after the cool-down it drafts again, from the history the engine resends.
    time.sleep(0.6)
    _answering([victim])
    results = engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats["accepted"] for r in results) > 0


def _answering(workers: list, within_s: float = 180.0) -> None:
    """Wait until every worker answers: a killed actor is back once Ray has restarted it and its model has loaded
    again, which takes longer on a busy machine."""
    deadline = time.monotonic() + within_s
    for worker in workers:
        while True:
            try:
                ray.get(worker.info.remote(), timeout=5)
                break
            except ray.exceptions.RayError:  # restarting, or not answering yet
                assert time.monotonic() < deadline, f"{worker} did not answer within {within_s} s"
                time.sleep(0.5)


def test_stalled_worker_misses_deadline_and_stream_goes_on(tiny_models, pool, expected) -> None:
    _answering(pool)  # the worker killed in the test before is back
    engine = _engine(tiny_models, pool, timeout_s=0.5, cooldown_s=30.0)
    request_id = engine.add_request(PROMPTS[2], GREEDY)
    engine.step()
    stalled = ray.get(_worker_of(engine, request_id).info.remote())["pid"]
    os.kill(stalled, signal.SIGSTOP)
    try:
        seq = engine.sequences[request_id]
        started = time.monotonic()
        while engine.has_unfinished():
            engine.step()
        assert seq.output == expected[2]
        assert engine.drafter.stats.timeouts == 1
        assert time.monotonic() - started < 20
    finally:
        os.kill(stalled, signal.SIGCONT)


def test_a_worker_still_stalled_after_its_cool_down_is_not_given_its_sessions_histories(tiny_models, pool) -> None:
    """Back from its cool-down, a stalled worker was sent every token its sessions had decoded meanwhile, under a
    deadline that grows with them: the engine's step waited that long, past a gateway's stall timeout, which failed
    every request. Now it must answer a probe first; until then its sessions decode plainly."""
    _answering(pool)
    engine = _engine(tiny_models, pool[:1], timeout_s=0.5, cooldown_s=0.5, per_token_s=0.05)
    params = SamplingParams(temperature=0.0, max_tokens=600, ignore_eos=True)
    seq = engine.sequences[engine.add_request(PROMPTS[0], params)]
    engine.step()
    stalled = ray.get(pool[0].info.remote())["pid"]
    os.kill(stalled, signal.SIGSTOP)
    slowest, resumed = 0.0, False
    try:
        while engine.has_unfinished():
            started = time.monotonic()
            engine.step()
            slowest = max(slowest, time.monotonic() - started)
            if not resumed and len(seq.output) >= 400:  # several cool-downs later
                os.kill(stalled, signal.SIGCONT)  # it answers again: drafting resumes past its cool-down
                resumed, drafted_then = True, seq.stats.drafted
                time.sleep(1.0)
    finally:
        os.kill(stalled, signal.SIGCONT)
    assert seq.output == build_engine(tiny_models[0], None).generate([PROMPTS[0]], params)[0].token_ids
    assert slowest < 3.0, slowest  # a missed deadline (0.5 s) or a probe (1 s), never a catch-up's deadline
    assert resumed and seq.stats.drafted > drafted_then


def test_a_worker_runs_its_forwards_on_the_threads_it_was_given(ray_cluster, tiny_dirs) -> None:
    """Ray sets an actor's OpenMP threads to the CPUs it reserves (one; this session's Ray says 1 as well), and
    `tandem serve` on its own host asks for every core (engines.cluster.worker_threads): a worker reports the threads
    of its model thread, where its forwards run, not those of the call thread that answers info()."""
    from tandem.engines.cluster import worker_threads
    from tandem.engines.options import ClusterOptions

    [worker] = start_draft_workers(WorkerConfig(model=str(tiny_dirs.draft), dtype="float32", threads=2), count=1)
    try:
        assert ray.get(worker.info.remote())["threads"] == 2
    finally:
        ray.kill(worker)
    cores = len(os.sched_getaffinity(0))
    assert worker_threads(ClusterOptions(), joined=False) == (cores, cores)
    assert worker_threads(ClusterOptions(tensor_parallel=2), joined=False) == (cores, max(1, cores // 2))
    assert worker_threads(ClusterOptions(), joined=True) == (None, None)
    assert worker_threads(ClusterOptions(threads=3), joined=False) == (3, 3)


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


def test_calibration_leaves_out_draft_calls_that_failed(tiny_models, pool) -> None:
    """A draft worker that misses its deadline during calibration (it happened in bf16 on one AVX2 core) gives empty
    proposals at once; timed, they priced a draft step at the cost of doing nothing, and AUTO would then draft as if
    drafting were free. Here every draft call misses its deadline: no draft timing counts, so AUTO is left
    uncalibrated (it drafts at k_init) while the target's forwards are timed."""
    from tandem.core.calibration import calibrate

    local = build_engine(tiny_models[0], None, EngineConfig(calibrate=False))
    drafter = RayDrafter(pool, timeout_s=0.0, per_token_s=0.0, cooldown_s=60)
    costs = calibrate(local.verifier, drafter, k_max=3, k_init=2, max_batch=2)
    assert drafter.stats.timeouts >= 1 and costs.draft_step == 0.0 and not costs.draft_rows
    assert not costs.draft_forward and not costs.calibrated
    assert set(costs.verify) >= {1, 2, 3, 4} and all(seconds > 0 for seconds in costs.verify.values())
    for seq_id in [f"__tandem_calibration__-{i}" for i in range(2)]:
        drafter.release(seq_id)


@pytest.fixture(scope="module")
def replicas(ray_cluster, tiny_dirs):
    yield from _actors(start_target_replicas, tiny_dirs.target)


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


def test_tensor_parallel_two_ranks_equal_one_and_a_dead_rank_rebuilds_the_group(tiny_models, tiny_dirs, ray_cluster,
                                                                               expected) -> None:
    from tandem.core.local import LocalDrafter
    from tandem.core.runner import ModelRunner
    from tandem.workers.tp_replica import start_tp_replica

    replica = start_tp_replica(WorkerConfig(model=str(tiny_dirs.target), dtype="float32", threads=1), size=2)
    local = build_engine(tiny_models[0], None, EngineConfig(calibrate=False))
    drafter = LocalDrafter(ModelRunner(tiny_models[1].model))
    verifier = RayVerifier([replica], timeout_s=60)
    engine = SpeculativeEngine(verifier, drafter, EngineConfig(spec=SpecConfig(adaptive=False, k_init=3),
                                                               calibrate=False),
                               local.eos_token_ids, local.decode)
    assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY)] == expected
    # Sampled through both ranks: a client's seed gives plain decoding's tokens; without one, the engine's seed
    # reaches both ranks, so rank 1 keeps the tokens rank 0 chose and the output is the in-process engine's.
    assert [r.token_ids for r in engine.generate(PROMPTS, SEEDED)] == _plain(tiny_models, SEEDED)
    unseeded = SamplingParams(temperature=0.8, top_k=20, max_tokens=24, ignore_eos=True)
    seqs = [engine.sequences[engine.add_request(p, unseeded)] for p in PROMPTS]
    while engine.has_unfinished():
        engine.step()
    in_process = build_engine(tiny_models[0], tiny_models[1],
                              EngineConfig(spec=SpecConfig(adaptive=False, k_init=3), calibrate=False))
    assert [s.output for s in seqs] == [r.token_ids for r in in_process.generate(PROMPTS, [s.params for s in seqs])]
    # A response format reaches every rank: each masks alike, so they stay in step.
    assert [r.token_ids for r in engine.generate(PROMPTS, FORMATTED)] == _plain(tiny_models, FORMATTED)
    # Prompt logprobs from the sharded forward: a plain forward's over the prompt.
    scored = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=2))
    for prompt, result in zip(PROMPTS, scored, strict=True):
        _assert_matches(tiny_models[0], prompt[:1], prompt[1:], result.prompt_logprobs, 2)
    shards = ray.get([rank.info.remote() for rank in replica.ranks])
    assert [s["sequences"] for s in shards] == [0, 0]
    assert verifier.kv_usage() == KVUsage.from_info(shards[0])  # the replica counts once, by rank 0
    # One rank dies mid-generation: the group is rebuilt and the sequences resume from their histories.
    seqs = [engine.sequences[engine.add_request(p, GREEDY)] for p in PROMPTS]
    engine.step()
    old_pids = [ray.get(rank.info.remote())["pid"] for rank in replica.ranks]
    os.kill(old_pids[1], signal.SIGKILL)
    started = time.monotonic()
    while engine.has_unfinished():
        engine.step()
    assert [s.output for s in seqs] == expected
    assert verifier.rebuilt == 1 and time.monotonic() - started < 60
    assert not set(old_pids) & {ray.get(rank.info.remote())["pid"] for rank in replica.ranks}
    for rank in replica.ranks:
        ray.kill(rank)
    ray.util.remove_placement_group(replica.group)


def test_a_tensor_parallel_rank_whose_model_fails_its_checks_stops_the_start_with_that_message(changed_model,
                                                                                                ray_cluster) -> None:
    """The serving process leaves the model's hash to the workers, which check what they load: a file changed after
    the pull stops a replica's start with the check's own message and the rank's host, not Ray's remote traceback,
    and leaves no rank or bundle behind. (A worker's constructor refusing its model: test_pools.py, through
    `tandem pools start`.)"""
    from tandem.errors import WorkerStartFailed
    from tandem.workers.tp_replica import start_tp_replica

    # An earlier test's actors and groups may still be going (Ray removes them asynchronously): what this start
    # leaves behind is a placement group that was not there before, or fewer free CPUs than before it.
    groups, free = _live_placement_groups(), ray.available_resources().get("CPU", 0)
    with pytest.raises(WorkerStartFailed) as refused:
        start_tp_replica(WorkerConfig(model=str(changed_model.path), dtype="float32", threads=1), size=2)
    host, rest = re.fullmatch(r"a tensor-parallel target worker on (\S+) could not start: (.*)",
                              str(refused.value)).groups()
    ipaddress.ip_address(host)  # where Ray says the rank ran
    assert rest.startswith(changed_model.refusal) and "Traceback" not in rest
    assert _eventually(lambda: _live_placement_groups() <= groups)
    assert _eventually(lambda: ray.available_resources().get("CPU", 0) >= free)


def _live_placement_groups() -> set[str]:
    return {group for group, info in ray.util.placement_group_table().items() if info["state"] != "REMOVED"}
