"""Draft workers as real Ray actors: pooled drafting gives plain decoding's tokens (greedy, sampled, under penalties
and a format) and in-process drafting's acceptance, output stays identical when a worker is killed or stalls, a
worker runs on the threads it was given, and calibration leaves out draft calls that failed."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

ray = pytest.importorskip("ray")

from ray_workers_harness import (  # noqa: E402 (the fixtures by their names: ray_cluster, pool, expected)
    FORMAT_REGEX,
    FORMATTED,
    GREEDY,
    PROMPTS,
    SEEDED,
    _answering,
    _engine,
    _eventually,
    _plain,
    expected_fixture,  # noqa: F401
    pool_fixture,  # noqa: F401
    ray_cluster_fixture,  # noqa: F401
)
from tandem.core.config import EngineConfig, SamplingParams, SpecConfig  # noqa: E402
from tandem.core.engine import SpeculativeEngine  # noqa: E402
from tandem.engines.local import build_engine  # noqa: E402
from tandem.workers.draft_pool import RayDrafter, start_draft_workers  # noqa: E402
from tandem.workers.worker_base import WorkerConfig  # noqa: E402


def test_the_in_process_ray_modules_share_one_xdist_group(request) -> None:
    """tests/conftest.py puts the modules that use the session's in-process Ray in one xdist group, so one worker
    starts it once. Two things spread them over every worker, silently: marks added after xdist's own hook has read
    them, and pytest 9.2, which no longer reads the node id xdist marks (pytest-dev/pytest-xdist#1386)."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not under pytest-xdist's --dist loadgroup")
    assert request.node.nodeid.endswith("@ray")


def test_pooled_drafting_is_exact_and_spreads_sessions(tiny_models, pool, expected) -> None:
    engine = _engine(tiny_models, pool)
    results = engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats["accepted"] for r in results) > 0
    assert not engine.drafter.affinity
    assert _eventually(lambda: ray.get([w.cached_sequences.remote() for w in pool]) == [0, 0])


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
    every request. Now it must answer a probe first; until then its sessions decode plainly. Counted, not timed (a
    loaded CI machine stretches any step): while it is stopped, the worker misses one deadline, the first call's,
    and is never sent another call to miss."""
    _answering(pool)
    engine = _engine(tiny_models, pool[:1], timeout_s=0.5, cooldown_s=0.5, per_token_s=0.05)
    params = SamplingParams(temperature=0.0, max_tokens=600, ignore_eos=True)
    seq = engine.sequences[engine.add_request(PROMPTS[0], params)]
    engine.step()
    stalled = ray.get(pool[0].info.remote())["pid"]
    os.kill(stalled, signal.SIGSTOP)
    resumed = False
    try:
        while engine.has_unfinished():
            engine.step()
            if not resumed and len(seq.output) >= 400:  # several cool-downs later
                timeouts_stalled, drafted_then = engine.drafter.stats.timeouts, seq.stats.drafted
                os.kill(stalled, signal.SIGCONT)  # it answers again: drafting resumes past its cool-down
                resumed = True
                time.sleep(1.0)
    finally:
        os.kill(stalled, signal.SIGCONT)
    assert seq.output == build_engine(tiny_models[0], None).generate([PROMPTS[0]], params)[0].token_ids
    assert resumed and timeouts_stalled == 1  # probes only, after the first miss: never a history to time out on
    assert seq.stats.drafted > drafted_then


def test_a_cool_down_ending_between_the_probe_and_the_routing_gives_the_stalled_worker_no_rows(
        tiny_models, pool, monkeypatch) -> None:
    """What made the test above flaky on a loaded machine: the round after its probe was skipped (the worker still
    cooling) was routed once the cool-down had ended, so the stalled worker was healthy again, unprobed, and missed a
    second deadline. Here that gap is made: the first round routed while it cools waits out the cool-down first."""
    from tandem.workers import draft_pool

    _answering(pool)
    engine = _engine(tiny_models, pool[:1], timeout_s=0.5, cooldown_s=0.5)
    router, real_fan_out, waited = engine.drafter.router, draft_pool.fan_out, []

    def late_fan_out(*args, **kwargs):
        if not waited and time.monotonic() < router.benched_until[0]:  # (cooling)
            waited.append(True)
            time.sleep(max(0.0, router.benched_until[0] - time.monotonic()) + 0.1)
        return real_fan_out(*args, **kwargs)

    monkeypatch.setattr(draft_pool, "fan_out", late_fan_out)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    seq = engine.sequences[engine.add_request(PROMPTS[1], params)]
    engine.step()
    stalled = ray.get(pool[0].info.remote())["pid"]
    os.kill(stalled, signal.SIGSTOP)
    try:
        while engine.has_unfinished():
            engine.step()
    finally:
        os.kill(stalled, signal.SIGCONT)
    assert waited and engine.drafter.stats.timeouts == 1
    assert seq.output == build_engine(tiny_models[0], None).generate([PROMPTS[1]], params)[0].token_ids


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
