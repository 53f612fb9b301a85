"""What the tests of Ray draft workers and target replicas (tests/test_ray_workers_*.py) share: the prompts and
sampling options they decode, module fixtures' actors, an engine over a draft pool, plain decoding's tokens, a
response format, and waits for fire-and-forget releases and for restarted actors."""

from __future__ import annotations

import time

import pytest
import ray

from tandem.core.config import EngineConfig, OutputFormat, SamplingParams, SpecConfig
from tandem.core.engine import SpeculativeEngine
from tandem.engines.local import build_engine
from tandem.workers.draft_pool import RayDrafter, start_draft_workers
from tandem.workers.target_pool import start_target_replicas
from tandem.workers.worker_base import WorkerConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
SEEDED = [SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=24, ignore_eos=True) for s in range(4)]
PROMPTS = [[72, 101, 108, 108, 111], [40, 50, 60], [1, 2, 3, 4, 5, 6, 7, 8, 9], [200, 17]]
FORMAT_REGEX = "[a-f]{3}( [0-9]{2}){1,4}"
FORMATTED = [SamplingParams(temperature=0.0, max_tokens=24, output_format=OutputFormat("regex", FORMAT_REGEX)),
             SamplingParams(temperature=0.8, seed=7, max_tokens=24,
                            output_format=OutputFormat("regex", FORMAT_REGEX))] * 2


def _actors(start, model_dir):
    """Two actors on a tiny model for the module, killed afterwards so later modules have the CPUs."""
    workers = start(WorkerConfig(model=str(model_dir), dtype="float32", threads=1), count=2)
    yield workers
    for worker in workers:
        ray.kill(worker)


def _engine(tiny_models, workers, **pool_options) -> SpeculativeEngine:
    local = build_engine(tiny_models[0], None, EngineConfig(calibrate=False))
    drafter = RayDrafter(workers, **pool_options)
    return SpeculativeEngine(local.verifier, drafter, EngineConfig(spec=SpecConfig(adaptive=False, k_init=4),
                                                                   calibrate=False),
                             local.eos_token_ids, local.decode)


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


# The module fixtures the modules share, one instance a module: a module imports those it takes by these names
# (pytest finds a fixture by the name it is given; the import keeps ruff from reading the test arguments as
# redefinitions).
@pytest.fixture(scope="module", name="ray_cluster")
def ray_cluster_fixture(ray_session):
    return ray_session


@pytest.fixture(scope="module", name="pool")
def pool_fixture(ray_cluster, tiny_dirs):
    yield from _actors(start_draft_workers, tiny_dirs.draft)


@pytest.fixture(scope="module", name="replicas")
def replicas_fixture(ray_cluster, tiny_dirs):
    yield from _actors(start_target_replicas, tiny_dirs.target)


@pytest.fixture(scope="module", name="expected")
def expected_fixture(tiny_models):
    return [r.token_ids for r in build_engine(tiny_models[0], None).generate(PROMPTS, GREEDY)]
