"""A tensor-parallel target replica of two Ray ranks: a one-rank engine's tokens (greedy, sampled, formatted) and
prompt logprobs, a group rebuilt when a rank dies, and a start stopped by a rank whose model fails its checks."""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import time

import pytest

ray = pytest.importorskip("ray")

from ray_workers_harness import (  # noqa: E402 (the fixtures by their names: ray_cluster, expected)
    FORMATTED,
    GREEDY,
    PROMPTS,
    SEEDED,
    _eventually,
    _plain,
    expected_fixture,  # noqa: F401
    ray_cluster_fixture,  # noqa: F401
)
from tandem.core.config import EngineConfig, SamplingParams, SpecConfig  # noqa: E402
from tandem.core.engine import SpeculativeEngine  # noqa: E402
from tandem.core.protocol import KVUsage  # noqa: E402
from tandem.engines.local import build_engine  # noqa: E402
from tandem.workers.target_pool import RayVerifier  # noqa: E402
from tandem.workers.worker_base import WorkerConfig  # noqa: E402
from test_logprobs import _assert_matches  # noqa: E402


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
