"""The engine as the serving layers meet it: bad sampling parameters and requests are refused naming the field, the
engine has every member core.serving_engine.ServingEngine names, and in-process arms sharing one target each get
their own tokens."""

from __future__ import annotations

import dataclasses

import pytest

from engine_harness import FIXED_K, PROMPT, _greedy
from tandem.core.config import SamplingParams, SpecConfig
from tandem.engines.local import build_engine
from tandem.errors import InvalidArgument


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"max_tokens": 0}, "max_tokens"), ({"seed": -5}, "seed"),
    ({"stop": ("",)}, "stop"), ({"stop_token_ids": (-1,)}, "stop_token_ids"),
])
def test_bad_sampling_parameters_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidArgument, match=f"^{field}:"):
        SamplingParams(**kwargs)


def test_bad_requests_are_rejected_with_clear_errors(tiny_models) -> None:
    engine = build_engine(tiny_models[0], tiny_models[1], FIXED_K)
    with pytest.raises(InvalidArgument, match=r"^prompt:"):
        engine.add_request([], _greedy())
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        engine.add_request([1, 10**6], _greedy())
    with pytest.raises(InvalidArgument, match=r"^stop_token_ids: \[1000000\] are outside the vocabulary"):
        engine.add_request(PROMPT, dataclasses.replace(_greedy(), stop_token_ids=(5, 10**6)))
    engine.add_request(PROMPT, _greedy(), request_id="x")
    with pytest.raises(InvalidArgument, match="already running"):
        engine.add_request(PROMPT, _greedy(), request_id="x")
    engine.abort("x")
    assert not engine.has_unfinished() and not engine.verifier.runner.states
    with pytest.raises(InvalidArgument, match=r"^k_max:"):
        SpecConfig(k_max=-1)


def test_in_process_arms_sharing_the_target_step_at_once_and_each_gets_its_own_tokens(tiny_dirs) -> None:
    """`serve --in-process` with canary arms loads the target once and runs an engine per arm, each on its own
    thread: their forwards on the one model object take turns (core.attention.forward_lock), where they once
    switched its attention implementation under each other (KeyError 'tandem_segments', or rows attended as one)."""
    import threading

    from tandem.engines.local import build_local_backends
    from tandem.engines.options import Arm, LocalOptions

    arms = (Arm("baseline", str(tiny_dirs.draft), FIXED_K), Arm("canary", str(tiny_dirs.draft_random), FIXED_K))
    backends = build_local_backends(str(tiny_dirs.target), arms, LocalOptions(device="cpu", dtype="float32"))
    engines = [backends[arm.name].engine for arm in arms]
    assert engines[0].verifier.runner.model is engines[1].verifier.runner.model
    prompts = [[(i * 31 + j * 7) % 250 + 3 for j in range(5 + 9 * i)] for i in range(6)]  # widths that pack
    alone = [[r.token_ids for r in engine.generate(prompts, _greedy(40))] for engine in engines]
    together: dict[tuple[int, int], list[list[int]]] = {}
    failures: list[BaseException] = []

    def run(arm: int) -> None:
        try:
            for repeat in range(4):
                together[arm, repeat] = [r.token_ids for r in engines[arm].generate(prompts, _greedy(40))]
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(arm,)) for arm in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not failures, failures
    assert all(together[arm, repeat] == alone[arm] for arm in range(2) for repeat in range(4))


def test_the_engine_has_every_member_the_serving_layers_use(tiny_models) -> None:
    """The gateway names core.serving_engine.ServingEngine, never the class: the engine must keep that face."""
    from tandem.core.serving_engine import ServingEngine

    target, draft, _ = tiny_models
    engine = build_engine(target, draft, FIXED_K)
    members = set(ServingEngine.__annotations__) | {name for name in vars(ServingEngine) if not name.startswith("_")}
    assert {"add_request", "step", "sequence", "max_batch", "verifier"} <= members
    assert [name for name in sorted(members) if not hasattr(engine, name)] == []
    request_id = engine.add_request(PROMPT, _greedy())
    assert engine.sequence(request_id).request_id == request_id and engine.max_batch == engine.config.max_batch
